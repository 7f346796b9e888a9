"""GrpcEngineClient: the ``EngineClient`` of a backend reached over gRPC (torch-free).

It speaks ``protos/tandem/engine/v1/engine.proto``: SamplingParams go out as
the proto's message, GenerateResponses come back as ``EngineOutput`` deltas,
and status codes become typed errors (``error_from_status``, the one place):

    INVALID_ARGUMENT    -> InvalidRequestError (param from ``tandem-error-param``)
    RESOURCE_EXHAUSTED  -> BackendOverloadedError
    UNAVAILABLE         -> BackendUnavailableError (also: connection refused,
                           a unary call past its deadline)
    anything else       -> BackendError
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import AsyncIterator, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from backend.errors import EngineDeadError, InvalidRequestError, TandemError
from backend.request import EngineLoad, EngineOutput, FinishReason, Logprob, ModelInfo, PositionLogprobs, SamplingParams
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

# The same limits as the backend's (backend/server.py), set on both ends.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
ERROR_PARAM_METADATA_KEY = "tandem-error-param"
UNARY_TIMEOUT_S = 30.0  # a backend that does not answer a unary call by then counts as unavailable
HEALTH_TIMEOUT_S = 1.0

_FINISH_REASON_FROM_PROTO = {
    engine_pb2.FINISH_REASON_UNSPECIFIED: None,
    engine_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    engine_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    engine_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}


class BackendError(TandemError, RuntimeError):
    """The backend failed a call for a reason other than those below; ``code`` is the gRPC status."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(message)
        self.code = code


class BackendUnavailableError(EngineDeadError):
    """The backend cannot be reached, is shutting down or its engine is dead (HTTP 503)."""


class BackendOverloadedError(TandemError):
    """The backend's waiting queue is full; retry later or elsewhere (HTTP 429)."""


def error_from_status(error: grpc.aio.AioRpcError) -> TandemError:
    """The typed error for a failed call."""
    code, message = error.code(), error.details() or error.code().name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        param = dict(error.trailing_metadata() or ()).get(ERROR_PARAM_METADATA_KEY)
        return InvalidRequestError(message, param=param)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return BackendUnavailableError(f"Backend unavailable: {message}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return BackendOverloadedError(message)
    return BackendError(f"Backend call failed ({code.name}): {message}", code)


# ---- engine types <-> proto ----------------------------------------------------------------


def sampling_params_to_proto(params: SamplingParams) -> engine_pb2.SamplingParams:
    """Every wire field set explicitly (stop strings stay here: the frontend matches them)."""
    message = engine_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        logprob_token_ids=params.logprob_token_ids or (), use_beam_search=params.use_beam_search,
        length_penalty=params.length_penalty)
    # None means "unset" on the wire, which is these fields' None on the backend.
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    constraint = params.structured_outputs
    if constraint is not None:
        wire = message.structured_outputs
        wire.disable_any_whitespace = constraint.disable_any_whitespace
        if constraint.json is not None:
            wire.json_schema = constraint.json
        elif constraint.json_object:
            wire.json_object.SetInParent()
        elif constraint.regex is not None:
            wire.regex = constraint.regex
        elif constraint.choice is not None:
            wire.choice.choices.extend(constraint.choice)
        else:
            wire.grammar = constraint.grammar
    return message


def position_logprobs_from_proto(position: engine_pb2.PositionLogprobs) -> PositionLogprobs:
    """``token`` first, then ``top_logprobs`` in order: the engine's dict layout."""
    return {entry.token_id: Logprob(entry.logprob, rank=entry.rank or None)
            for entry in (position.token, *position.top_logprobs)}


def output_from_response(request_id: str, response: engine_pb2.GenerateResponse) -> EngineOutput:
    prompt_logprobs = None
    if response.HasField("prompt_logprobs"):
        prompt_logprobs = [None] + [position_logprobs_from_proto(p) for p in response.prompt_logprobs.positions]
    return EngineOutput(
        request_id=request_id, index=response.index, new_token_ids=list(response.new_token_ids),
        new_logprobs=[position_logprobs_from_proto(p) for p in response.new_logprobs] or None,
        finish_reason=_FINISH_REASON_FROM_PROTO[response.finish_reason],
        stop_reason=response.stop_token_id if response.HasField("stop_token_id") else None,
        num_prompt_tokens=response.num_prompt_tokens, num_cached_tokens=response.num_cached_tokens,
        prompt_logprobs=prompt_logprobs)


# ---- the client ----------------------------------------------------------------------------


class GrpcEngineClient:
    """``EngineClient`` over a backend's gRPC address (``host:port``).

    The channel is opened on first use, inside the running event loop (a
    ``grpc.aio`` channel belongs to the loop that created it).
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel: Optional[grpc.aio.Channel] = None
        self._stub: Optional[engine_pb2_grpc.EngineServiceStub] = None
        self._health: Optional[health_pb2_grpc.HealthStub] = None

    def _connect(self) -> None:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                self.address, options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                       ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
            self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def _engine(self) -> engine_pb2_grpc.EngineServiceStub:
        self._connect()
        return self._stub

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[EngineOutput]:
        """Stream the request's deltas. Closing the iterator early (or cancelling the
        task) cancels the call, which aborts the request on the backend."""
        try:
            request = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                                 sampling_params=sampling_params_to_proto(params))
        except ValueError as error:  # e.g. a negative token ID, which uint32 cannot hold
            raise InvalidRequestError(f"The request cannot be sent to the backend: {error}") from None
        call = self._engine.Generate(request)
        try:
            async for response in call:
                yield output_from_response(request_id, response)
        except grpc.aio.AioRpcError as error:
            raise error_from_status(error) from None
        finally:
            call.cancel()  # a no-op once the stream has ended

    async def abort(self, request_id: str) -> None:
        await self._unary(self._engine.Abort, engine_pb2.AbortRequest(request_ids=[request_id]))

    async def model_info(self) -> ModelInfo:
        info = await self._unary(self._engine.GetModelInfo, engine_pb2.GetModelInfoRequest())
        return ModelInfo(
            model_name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            bos_token_id=info.bos_token_id if info.HasField("bos_token_id") else None,
            pad_token_id=info.pad_token_id if info.HasField("pad_token_id") else None)

    async def tokenizer_fingerprint(self) -> str:
        """The backend's tokenizer fingerprint (``backend.tokenizer_files.tokenizer_fingerprint``)."""
        info = await self._unary(self._engine.GetModelInfo, engine_pb2.GetModelInfoRequest())
        return info.tokenizer_fingerprint

    async def get_load(self) -> EngineLoad:
        load = await self._unary(self._engine.GetLoad, engine_pb2.GetLoadRequest())
        return EngineLoad(load.num_requests_running, load.num_requests_waiting, load.kv_cache_usage)

    async def metrics_text(self) -> str:
        """The backend's Prometheus metrics (text exposition format)."""
        response = await self._unary(self._engine.GetMetrics, engine_pb2.GetMetricsRequest())
        return response.prometheus_text

    async def health(self) -> bool:
        """True when the backend answers SERVING within ``HEALTH_TIMEOUT_S``; False otherwise."""
        self._connect()
        try:
            response = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def fetch_tokenizer(self, dest_dir: str | os.PathLike) -> Path:
        """Write the backend's tokenizer files into ``dest_dir`` (created if needed); return it.

        Files are written only once all have arrived whole. Raises ``BackendError``
        for a file name that could escape ``dest_dir`` or chunks that do not add
        up to the announced file size.
        """
        files: dict[str, bytearray] = {}
        sizes: dict[str, int] = {}
        call = self._engine.GetTokenizer(engine_pb2.GetTokenizerRequest(), timeout=UNARY_TIMEOUT_S)
        try:
            async for chunk in call:
                if chunk.file_name not in files:
                    _check_file_name(chunk.file_name)
                    files[chunk.file_name], sizes[chunk.file_name] = bytearray(), chunk.file_size
                data = files[chunk.file_name]
                if chunk.offset != len(data):
                    raise BackendError(f"Tokenizer file {chunk.file_name!r}: a chunk starts at byte "
                                       f"{chunk.offset}, expected {len(data)}.")
                data += chunk.data
        except grpc.aio.AioRpcError as error:
            raise error_from_status(error) from None
        incomplete = [name for name, data in files.items() if len(data) != sizes[name]]
        if not files or incomplete:
            raise BackendError(f"The tokenizer files arrived incomplete: {incomplete or 'none sent'}.")
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (dest / name).write_bytes(data)
        return dest

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _unary(self, method, request):
        try:
            return await method(request, timeout=UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            raise error_from_status(error) from None


def _check_file_name(name: str) -> None:
    if not name or "/" in name or "\\" in name or ".." in name:
        raise BackendError(f"Refusing tokenizer file name {name!r}: it could point outside the directory.")
