"""/score (vLLM's) and /rerank (Jina's and Cohere's shape, as vLLM serves it): texts scored by the
cosine similarity of their embeddings.

Each text is pooled as /v1/embeddings pools it (``OpenAIServingEmbedding.pooled_prompts`` and
``pooled_vectors``: the same checks and bounds, one engine embed request per text, all aborted
together), and a query or a ``text_1`` shared by every pair is pooled once. The served model is a
bi-encoder here: the fields vLLM defines for a cross-encoder's score are refused.
"""

from __future__ import annotations

import math
import operator
import uuid
from typing import Union

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backend.types.errors import InvalidRequestError
from backend.types.pooling import PoolingParams
from frontend import protocol as P
from frontend.serving.base import OpenAIServing, ServingContext
from frontend.serving.embeddings import OpenAIServingEmbedding, usage_of


class OpenAIServingScores(OpenAIServing):
    """POST /score (and /v1/score), /rerank (and /v1/rerank, /v2/rerank), over the embeddings endpoint."""

    def __init__(self, context: ServingContext, embedding: OpenAIServingEmbedding) -> None:
        super().__init__(context)
        self.embedding = embedding

    async def create_score(self, request: P.ScoreRequest, raw_request: Request) -> Response:
        self._check_scoring_fields(request)
        texts_1, texts_2 = _as_list(request.text_1, "text_1"), _as_list(request.text_2, "text_2")
        pairs = score_pairs(len(texts_1), len(texts_2))
        base_id = f"score-{uuid.uuid4().hex}"
        scores, prompts = await self._cosines(raw_request, base_id, request, texts_1, "text_1", texts_2, "text_2",
                                              pairs)
        data = [P.ScoreData(index=i, score=score) for i, score in enumerate(scores)]
        return self._json(P.ScoreResponse(id=base_id, model=self.model_name, data=data, usage=usage_of(prompts)))

    async def create_rerank(self, request: P.RerankRequest, raw_request: Request) -> Response:
        self._check_scoring_fields(request)
        documents = _as_list(request.documents, "documents")
        if request.top_n is not None and request.top_n < 0:
            raise InvalidRequestError(f"top_n must be at least 0 (0: every document); got {request.top_n}.",
                                      param="top_n")
        base_id = f"rerank-{uuid.uuid4().hex}"
        scores, prompts = await self._cosines(raw_request, base_id, request, [request.query], "query", documents,
                                              "documents", [(0, j) for j in range(len(documents))])
        ranked = sorted(range(len(documents)), key=lambda j: -scores[j])  # stable: ties keep their order
        if request.top_n:
            ranked = ranked[:request.top_n]
        results = [P.RerankResult(index=j, relevance_score=scores[j],
                                  document=P.RerankDocument(text=documents[j]) if request.return_documents else None)
                   for j in ranked]
        response = P.RerankResponse(id=base_id, model=self.model_name, usage=usage_of(prompts), results=results)
        # Without return_documents a result has no ``document`` key (not a null one), as Cohere answers.
        return JSONResponse(response.model_dump(mode="json", exclude_none=True))

    def _check_scoring_fields(self, request: P.ScoringFields) -> None:
        """The served model, and none of the fields this server cannot honour."""
        self._check_model(request.model)
        for name in P.CROSS_ENCODER_FIELDS:
            if getattr(request, name) is not None:
                raise InvalidRequestError(
                    f"{name} shapes a cross-encoder's score; this server scores by the cosine similarity of "
                    f"embeddings: leave `{name}` out.", param=name)
        if request.priority not in (None, 0):
            raise InvalidRequestError(f"{P.UNSUPPORTED_FIELDS['priority']}; leave `priority` out.", param="priority")
        if request.mm_processor_kwargs is not None:
            raise InvalidRequestError(f"{P.UNSUPPORTED_FIELDS['mm_processor_kwargs']}; leave `mm_processor_kwargs` "
                                      "out.", param="mm_processor_kwargs")

    async def _cosines(self, raw_request: Request, base_id: str, request: P.ScoringFields, left: list[str],
                       left_param: str, right: list[str], right_param: str,
                       pairs: list[tuple[int, int]]) -> tuple[list[float], list]:
        """(the cosine of each pair (i, j) of ``left[i]`` and ``right[j]``, the prompts pooled).
        Both sides are tokenized and checked before either is sent to the engine."""
        self.embedding.check_count(left, left_param)
        self.embedding.check_count(right, right_param)
        truncate = request.truncate_prompt_tokens
        side = request.truncation_side
        left_prompts = await self.embedding.pooled_prompts(left, True, truncate, param=left_param, truncation_side=side)
        right_prompts = await self.embedding.pooled_prompts(right, True, truncate, param=right_param,
                                                            truncation_side=side)
        prompts = left_prompts + right_prompts
        vectors = await self.embedding.pooled_vectors(raw_request, base_id, prompts,
                                                      PoolingParams(request.pooling_type, normalize=True))
        left_vectors, right_vectors = vectors[:len(left)], vectors[len(left):]
        return [cosine(left_vectors[i], right_vectors[j]) for i, j in pairs], prompts


def score_pairs(num_1: int, num_2: int) -> list[tuple[int, int]]:
    """The (text_1 index, text_2 index) pairs vLLM scores: 1:1, 1:N (text_1 against each of
    text_2) or N:N (in order); any other pair of lengths is a 400."""
    if num_1 == 1:
        return [(0, j) for j in range(num_2)]
    if num_1 != num_2:
        raise InvalidRequestError(
            f"text_1 holds {num_1} texts and text_2 {num_2}: give one text_1 (scored against each text_2) "
            "or as many of each (scored in pairs, in order).", param="text_2")
    return [(i, i) for i in range(num_1)]


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two vectors; 0 when either is zero."""
    norms = math.sqrt(sum(map(operator.mul, a, a))) * math.sqrt(sum(map(operator.mul, b, b)))
    return sum(map(operator.mul, a, b)) / norms if norms else 0.0


def _as_list(value: Union[str, list[str]], param: str) -> list[str]:
    """A text, or a non-empty list of texts (their count is bounded by ``pooled_prompts``)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidRequestError(f"{param} must not be empty.", param=param)
    return value
