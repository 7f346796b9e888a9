"""vLLM's /score and the Jina/Cohere-style /rerank: the request and response bodies.

Both score texts by the cosine similarity of their embeddings (the served model is a bi-encoder
here, never a cross-encoder); the fields vLLM defines only for cross-encoders are declared, so a
400 names them when set (``CROSS_ENCODER_FIELDS``), and left out of the schema.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, StrictInt, StrictStr
from pydantic.json_schema import SkipJsonSchema

from frontend.protocol.common import RequestModel, ResponseModel, created_now
from frontend.protocol.embeddings import EmbeddingUsage

# vLLM's request fields that shape a cross-encoder's (classifier's) score: refused when set.
CROSS_ENCODER_FIELDS = ("use_activation", "activation", "softmax")


class ScoringFields(RequestModel):
    """What /score and /rerank share."""

    model: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None  # each text's last tokens (-1: as many as the model takes)
    truncation_side: Optional[Literal["left", "right"]] = None  # "right": the first tokens instead
    # Tandem's, as in /v1/embeddings: how each text's final hidden states are pooled.
    pooling_type: Literal["last", "mean", "cls"] = "last"
    # Refused when set: CROSS_ENCODER_FIELDS, and priority other than 0 and mm_processor_kwargs
    # (UNSUPPORTED_FIELDS).
    use_activation: SkipJsonSchema[Optional[bool]] = None
    activation: SkipJsonSchema[Optional[bool]] = None
    softmax: SkipJsonSchema[Optional[bool]] = None
    priority: SkipJsonSchema[Optional[int]] = None  # 0 (the default priority) is accepted
    mm_processor_kwargs: SkipJsonSchema[Optional[dict[str, Any]]] = None


class ScoreRequest(ScoringFields):
    """``text_1`` against ``text_2``: one against one, one against each of N, or N against N in
    order (the i-th of ``text_1`` with the i-th of ``text_2``)."""

    text_1: Union[StrictStr, list[StrictStr]]
    text_2: Union[StrictStr, list[StrictStr]]


class ScoreData(ResponseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=created_now)
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(ScoringFields):
    query: StrictStr
    documents: list[StrictStr]
    top_n: Optional[StrictInt] = None  # the best n results; unset or 0: every document (vLLM's 0)
    return_documents: bool = True  # each result carries its document's text (vLLM always does)


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int  # the document's position in ``documents``
    relevance_score: float
    document: Optional[RerankDocument] = None


class RerankResponse(ResponseModel):
    id: str
    model: str
    usage: EmbeddingUsage
    results: list[RerankResult]  # the most relevant first
