"""EngineClient: the one interface between frontend-side processing and an engine.

Two implementations: ``backend.engine.AsyncLLMEngine`` (in process, used by the
offline ``LLM``) and ``GrpcEngineClient`` (a backend over gRPC, used by the HTTP
server). Both speak token IDs only and stream ``EngineOutput`` deltas.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional, Protocol, runtime_checkable

from backend.types.outputs import EngineLoad, EngineOutput, ModelInfo
from backend.types.pooling import PoolingParams
from backend.types.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 deadline: Optional[float] = None, cache_salt: Optional[str] = None) -> AsyncIterator[EngineOutput]:
        """Stream one request's deltas until every sequence of it has finished.

        Raises ``InvalidRequestError`` (before the first delta) for bad input,
        ``OverloadedError`` when admission control refuses it. Closing the
        iterator early (or cancelling its task) aborts the request. Past
        ``deadline`` (``time.monotonic()`` seconds) the engine aborts it.
        ``cache_salt``: only requests with the same salt share prefix-cache blocks.
        """
        ...

    async def embed(self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams, *,
                    deadline: Optional[float] = None) -> list[float]:
        """One prompt's final hidden states pooled (fp32); raises as ``generate`` does."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown IDs are ignored."""
        ...

    async def model_info(self) -> ModelInfo:
        ...

    async def get_load(self) -> EngineLoad:
        ...

    async def health(self) -> bool:
        """True while the engine can take requests."""
        ...
