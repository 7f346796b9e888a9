"""/v1/embeddings (OpenAI's): each input's final hidden states, pooled by the engine.

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
    """POST /v1/embeddings."""

    _vector_size: Optional[int] = None  # learnt from the first vector, where the backend did not say

    @property
    def hidden_size(self) -> Optional[int]:
        """The embedding size: the backend's model info says it; older backends' first answer does."""
        return self.model_info.hidden_size or self._vector_size

    async def create_embedding(self, request: P.EmbeddingRequest, raw_request: Request) -> Response:
        self._check_model(request.model)
        self._check_dimensions(request.dimensions)
        prompts = [self.renderer.truncate(prompt, request.truncate_prompt_tokens)
                   for prompt in await self._prompts(request.input, request.add_special_tokens)]
        max_len = self.model_info.max_model_len
        for prompt in prompts:
            if len(prompt.token_ids) >= max_len:  # the engine computes the prompt and one more position
                raise InvalidRequestError(
                    f"An input has {len(prompt.token_ids)} tokens; this model takes at most {max_len - 1} "
                    "per input. Please reduce the length of the input.", param="input")
        base_id = f"embd-{uuid.uuid4().hex}"
        deadline = self._deadline()
        pooling = PoolingParams(request.pooling_type, request.normalize)
        self.context.num_in_flight += 1
        try:
            vectors = await unless_disconnected(raw_request, _gather(
                self.engine_client.embed(f"{base_id}-{i}", prompt.token_ids, pooling, deadline=deadline)
                for i, prompt in enumerate(prompts)))
        finally:
            self.context.num_in_flight -= 1
        self._vector_size = len(vectors[0])
        self._check_dimensions(request.dimensions)
        data = [P.EmbeddingData(index=i, embedding=_encode(vector, request.encoding_format))
                for i, vector in enumerate(vectors)]
        num_tokens = sum(len(prompt.token_ids) for prompt in prompts)
        return self._json(P.EmbeddingResponse(id=base_id, model=self.model_name, data=data,
                                              usage=P.EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)))

    def _check_dimensions(self, dimensions: Optional[int]) -> None:
        """``dimensions`` is only the model's hidden size: vectors are not shortened or projected."""
        if dimensions is None:
            return
        if dimensions < 1 or (self.hidden_size is not None and dimensions != self.hidden_size):
            size = f"{self.hidden_size}" if self.hidden_size is not None else "its hidden size"
            raise InvalidRequestError(f"dimensions must be this model's embedding size ({size}) or left out; "
                                      f"got {dimensions}.", param="dimensions")

    async def _prompts(self, value, add_special_tokens: bool) -> list[Prompt]:
        """The inputs as prompts (the completions ``prompt`` field's shapes and checks, named
        ``input``); their count is checked here first, to name ``input`` in the error."""
        count = len(value) if isinstance(value, list) and value and not isinstance(value[0], int) else 1
        limit = self.limits.max_prompts_per_request
        if count > limit:
            raise InvalidRequestError(f"input holds {count} inputs; at most {limit} (--max-prompts-per-request) "
                                      "are allowed in one request.", param="input")
        return await self.renderer.completion_prompts(value, 1, add_special_tokens, param="input")


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
