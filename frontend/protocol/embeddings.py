"""/v1/embeddings (OpenAI's, with vLLM's extensions) and vLLM's /pooling: the request and response bodies."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, StrictInt, StrictStr

from frontend.protocol.common import RequestModel, ResponseModel, created_now


class EmbeddingRequest(RequestModel):
    # A string, a list of strings, token IDs, or a list of token-ID lists.
    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    # Only the model's hidden size (or unset): the vectors are not truncated or projected.
    dimensions: Optional[int] = None
    user: Optional[str] = None  # IGNORED_FIELDS
    # vLLM's extensions.
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    truncation_side: Optional[Literal["left", "right"]] = None  # "right" keeps the first tokens, else the last
    normalize: bool = True  # scale each vector to unit L2 norm
    # Tandem's: how the final hidden states are pooled (``last``: the last token's, as vLLM pools
    # a causal language model; ``mean``: over every token; ``cls``: the first token's).
    pooling_type: Literal["last", "mean", "cls"] = "last"


class EmbeddingData(ResponseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str]  # floats, or base64 of little-endian float32 bytes


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=created_now)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the embeddings body; ``task`` is only ``embed`` (the one pooling task served)."""

    task: Optional[Literal["embed"]] = None


class PoolingData(ResponseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Union[list[float], str]  # floats, or base64 of little-endian float32 bytes


class PoolingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=created_now)
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage
