"""/v1/embeddings (OpenAI's) and /pooling (vLLM's): each input's final hidden states, pooled by the engine.

Every input (a text, token IDs, or a list of either) becomes one engine embed request
(``EngineClient.embed``); they run concurrently and are all aborted if one fails or the client
goes away. The count of inputs, each text's length and each token list's length and IDs are
checked before any is sent.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import uuid
from array import array
from typing import Optional

from starlette.requests import Request
from starlette.responses import Response

from backend.types.errors import InvalidRequestError
from backend.types.pooling import PoolingParams
from frontend import protocol as P
from frontend.serving.base import OpenAIServing, unless_disconnected
from frontend.serving.prompts import Prompt


class OpenAIServingEmbedding(OpenAIServing):
    """POST /v1/embeddings and vLLM's /pooling; ``pooled_prompts`` and ``pooled_vectors`` also
    serve /score and /rerank (``frontend.serving.scoring``)."""

    _vector_size: Optional[int] = None  # learnt from the first vector, where the backend did not say

    @property
    def hidden_size(self) -> Optional[int]:
        """The embedding size: the backend's model info says it; older backends' first answer does."""
        return self.model_info.hidden_size or self._vector_size

    async def create_embedding(self, request: P.EmbeddingRequest, raw_request: Request) -> Response:
        base_id, prompts, vectors = await self._pool(request, raw_request, "embd")
        data = [P.EmbeddingData(index=i, embedding=_encode(vector, request.encoding_format))
                for i, vector in enumerate(vectors)]
        return self._json(P.EmbeddingResponse(id=base_id, model=self.model_name, data=data, usage=usage_of(prompts)))

    async def create_pooling(self, request: P.PoolingRequest, raw_request: Request) -> Response:
        """vLLM's /pooling: the same vectors as /v1/embeddings, in its ``data`` items."""
        base_id, prompts, vectors = await self._pool(request, raw_request, "pool")
        data = [P.PoolingData(index=i, data=_encode(vector, request.encoding_format))
                for i, vector in enumerate(vectors)]
        return self._json(P.PoolingResponse(id=base_id, model=self.model_name, data=data, usage=usage_of(prompts)))

    async def _pool(self, request: P.EmbeddingRequest, raw_request: Request, id_prefix: str):
        """(the request's ID, its prompts, their pooled vectors), every input checked before any is sent."""
        self._check_model(request.model)
        self._check_dimensions(request.dimensions)
        prompts = await self.pooled_prompts(request.input, request.add_special_tokens, request.truncate_prompt_tokens,
                                            truncation_side=request.truncation_side)
        base_id = f"{id_prefix}-{uuid.uuid4().hex}"
        vectors = await self.pooled_vectors(raw_request, base_id, prompts,
                                            PoolingParams(request.pooling_type, request.normalize))
        self._check_dimensions(request.dimensions)
        return base_id, prompts, vectors

    async def pooled_prompts(self, value, add_special_tokens: bool, truncate_prompt_tokens: Optional[int],
                             param: str = "input", truncation_side: Optional[str] = None) -> list[Prompt]:
        """The inputs as prompts (the completions ``prompt`` field's shapes and checks, named
        ``param``), each truncated as asked (``truncation_side``: vLLM's, ``PromptRenderer.truncate``)
        and short enough to pool. Their count is checked
        first, to name ``param`` in the error."""
        self.check_count(value, param)
        max_len = self.model_info.max_model_len
        if truncate_prompt_tokens == -1:  # as many as an input may have (the engine adds one position)
            truncate_prompt_tokens = max_len - 1
        prompts = [self.renderer.truncate(prompt, truncate_prompt_tokens, truncation_side)
                   for prompt in await self.renderer.completion_prompts(value, 1, add_special_tokens, param=param)]
        for prompt in prompts:
            if len(prompt.token_ids) >= max_len:  # the engine computes the prompt and one more position
                raise InvalidRequestError(
                    f"An input has {len(prompt.token_ids)} tokens; this model takes at most {max_len - 1} "
                    f"per input. Please reduce the length of the input.", param=param)
        return prompts

    def check_count(self, value, param: str = "input") -> None:
        """At most --max-prompts-per-request inputs (a text or one token-ID list counts as one)."""
        count = len(value) if isinstance(value, list) and value and not isinstance(value[0], int) else 1
        limit = self.limits.max_prompts_per_request
        if count > limit:
            raise InvalidRequestError(f"{param} holds {count} inputs; at most {limit} (--max-prompts-per-request) "
                                      "are allowed in one request.", param=param)

    async def pooled_vectors(self, raw_request: Request, base_id: str, prompts: list[Prompt],
                             pooling: PoolingParams) -> list[list[float]]:
        """Each prompt's pooled vector, one engine request each (``<base_id>-<i>``), run
        concurrently; all are aborted if one fails or the client goes away."""
        deadline = self._deadline()
        self.context.num_in_flight += 1
        try:
            vectors = await unless_disconnected(raw_request, _gather(
                self.engine_client.embed(f"{base_id}-{i}", prompt.token_ids, pooling, deadline=deadline)
                for i, prompt in enumerate(prompts)))
        finally:
            self.context.num_in_flight -= 1
        self._vector_size = len(vectors[0])
        return vectors

    def _check_dimensions(self, dimensions: Optional[int]) -> None:
        """``dimensions`` is only the model's hidden size: vectors are not shortened or projected."""
        if dimensions is None:
            return
        if dimensions < 1 or (self.hidden_size is not None and dimensions != self.hidden_size):
            size = f"{self.hidden_size}" if self.hidden_size is not None else "its hidden size"
            raise InvalidRequestError(f"dimensions must be this model's embedding size ({size}) or left out; "
                                      f"got {dimensions}.", param="dimensions")


def usage_of(prompts: list[Prompt]) -> P.EmbeddingUsage:
    num_tokens = sum(len(prompt.token_ids) for prompt in prompts)
    return P.EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)


async def _gather(calls) -> list[list[float]]:
    """Run the embed calls concurrently; if one fails, the others are cancelled (and aborted)."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _encode(vector: list[float], encoding_format: str):
    """Floats, or OpenAI's base64: the vector's float32 values as little-endian bytes."""
    if encoding_format == "float":
        return vector
    values = array("f", vector)
    if values.itemsize != 4:
        raise RuntimeError("This platform's C float is not 4 bytes.")
    if sys.byteorder != "little":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")
