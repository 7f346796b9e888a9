"""The backend's gRPC server: EngineService over an in-process engine, plus health, reflection, metrics.

    python -m backend.server [MODEL] [--host 127.0.0.1] [--port 50051] [--metrics-port 8001]
        [--auth-token TOKEN] [--ssl-certfile F --ssl-keyfile F [--ssl-ca-certs F]] [--insecure] [engine flags]

A Generate call becomes one engine request (proto -> ``SamplingParams``) whose
``EngineOutput`` deltas stream back as ``GenerateResponse``s. However the call
ends early (client cancel, deadline, Abort, server stop), the engine's stream
is closed, which aborts the request and frees its KV blocks at once; a call's
deadline also travels into the engine, which aborts the request when it
passes. Exceptions become status codes in one place, ``map_errors``; a
message that does not decode is INVALID_ARGUMENT, never UNKNOWN.

Security (``backend.auth``): loopback by default; beyond it, a token
(checked by one interceptor, UNAUTHENTICATED otherwise) or mutual TLS, unless
``--insecure``. Health stays open; metrics bind apart (``--metrics-host``,
loopback by default). Abort stops only the caller's own requests.

Admission control: a Generate call whose sequences would take the ones in
flight past ``max_num_seqs + --max-num-queued-requests`` is refused at once
with RESOURCE_EXHAUSTED. Every bound is a ``Limits`` field (backend/limits.py).

On SIGTERM/SIGINT the server drains: health turns NOT_SERVING, new Generate
calls get UNAVAILABLE, running streams get ``--shutdown-timeout`` seconds to
finish and are then cancelled; the process exits 0. If the engine dies,
health turns NOT_SERVING at once, the server drains the same way and the
process exits 1, so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.metadata
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import generate_latest

from backend import grpc_logs
from backend.auth import TOKEN_ENV, ServerSecurity
from backend.config import EngineConfig
from backend.engine import AsyncLLMEngine
from backend.errors import (EngineDeadError, InvalidRequestError, OverloadedError, RequestFailedError,
                            RequestTimeoutError, TandemError)
from backend.limits import BACKEND_LIMITS, Limits
from backend.metrics import EngineMetrics
from backend.ports import check_port_free, port_error
from backend.request import (EngineOutput, FinishReason, Logprob, PositionLogprobs, SamplingParams,
                             StructuredOutputsParams)
from backend.tokenizer_files import tokenizer_file_names, tokenizer_fingerprint
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
SERVICE_NAME = SERVICE.full_name
TOKENIZER_CHUNK_BYTES = 1024 * 1024  # the proto's per-chunk maximum
ERROR_PARAM_METADATA_KEY = "tandem-error-param"
DEFAULT_MAX_CONNECTION_AGE_S = 300.0
ENGINE_HEALTH_POLL_S = 0.5
# A client's deadline timer starts before ours (we start ours when its headers arrive), so its
# cancel at the deadline reaches us up to a transit time early; an end this close counts as expired.
DEADLINE_EARLY_CANCEL_S = 0.1

_FINISH_REASON_TO_PROTO = {
    None: engine_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: engine_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: engine_pb2.FINISH_REASON_ABORT,
}


class BackendShuttingDownError(TandemError):
    """The server is draining before it stops; send the request to another backend."""


# ---- errors -> status codes (the one place) -----------------------------------------------

_STATUS_OF_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (BackendShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (RequestTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (RequestFailedError, grpc.StatusCode.INTERNAL),  # one request failed in the engine; it goes on
)


class UndecodableRequest:
    """What a request deserializer returns for bytes that are not a valid message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


Handler = Callable[["EngineServicer", object, grpc.aio.ServicerContext], Awaitable[object]]


def map_errors(handler: Handler) -> Handler:
    """End the call with the status code of the error the handler raised.

    Handlers are coroutines (streams use ``context.write``), so every call ends
    inside the handler and its ``finally`` blocks run at once on cancellation.
    An error not listed in ``_STATUS_OF_ERROR`` is a bug: it is logged and
    ends the call INTERNAL (never UNKNOWN).
    """

    @functools.wraps(handler)
    async def handle(self: "EngineServicer", request: object, context: grpc.aio.ServicerContext) -> object:
        try:
            if isinstance(request, UndecodableRequest):
                raise InvalidRequestError(f"The request message does not decode: {request.error}")
            return await handler(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:  # noqa: BLE001 -- every error ends the call with a status
            code = next((code for kind, code in _STATUS_OF_ERROR if isinstance(error, kind)), None)
            if code is None:
                logger.error("%s failed", handler.__name__, exc_info=error)
                code = grpc.StatusCode.INTERNAL
            if self.metrics is not None:
                self.metrics.observe_rejected(handler.__name__, code.name.lower())
            param = getattr(error, "param", None)
            await context.abort(code, str(error) or type(error).__name__,
                                trailing_metadata=((ERROR_PARAM_METADATA_KEY, param),) if param else ())

    return handle


def _safe_deserializer(message_class):
    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception as error:  # noqa: BLE001 -- DecodeError and friends: the handler refuses it
            return UndecodableRequest(error)

    return deserialize


def engine_service_handler(servicer: "EngineServicer") -> grpc.GenericRpcHandler:
    """EngineService's method handlers (the generated ``add_..._to_server``'s, with deserializers
    that hand undecodable bytes to the handler instead of failing the call as UNKNOWN)."""
    handlers = {}
    for method in SERVICE.methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_safe_deserializer(getattr(engine_pb2, method.input_type.name)),
            response_serializer=getattr(engine_pb2, method.output_type.name).SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


# ---- proto <-> engine types -------------------------------------------------------------------


def sampling_params_from_proto(message: engine_pb2.SamplingParams) -> SamplingParams:
    """Proto -> SamplingParams (same field names); validation errors name the field.

    An unset ``optional`` field takes SamplingParams' default, except
    max_tokens: unset means no limit but max_model_len (the proto's contract).
    """
    kwargs: dict[str, object] = {"max_tokens": None}
    for field in message.DESCRIPTOR.fields:
        if field.has_presence and not message.HasField(field.name):
            continue
        value = getattr(message, field.name)
        kwargs[field.name] = list(value) if field.is_repeated else value
    kwargs["logprob_token_ids"] = kwargs["logprob_token_ids"] or None  # empty: off
    if "structured_outputs" in kwargs:
        kwargs["structured_outputs"] = structured_outputs_from_proto(message.structured_outputs)
    return SamplingParams(**kwargs)


def structured_outputs_from_proto(message: engine_pb2.StructuredOutputs) -> StructuredOutputsParams:
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequestError("structured_outputs is set but holds no constraint.", param="structured_outputs")
    value = {"json_schema": lambda: {"json": message.json_schema}, "json_object": lambda: {"json_object": True},
             "regex": lambda: {"regex": message.regex}, "choice": lambda: {"choice": list(message.choice.choices)},
             "grammar": lambda: {"grammar": message.grammar}}[kind]()
    return StructuredOutputsParams(**value, disable_any_whitespace=message.disable_any_whitespace)


def _logprob_to_proto(token_id: int, logprob: Logprob) -> engine_pb2.Logprob:
    return engine_pb2.Logprob(token_id=token_id, logprob=logprob.logprob, rank=logprob.rank or 0)


def position_logprobs_to_proto(position: PositionLogprobs) -> engine_pb2.PositionLogprobs:
    """The dict's first entry (the chosen token) -> ``token``; the rest, in order -> ``top_logprobs``."""
    (token_id, chosen), *alternatives = position.items()
    return engine_pb2.PositionLogprobs(
        token=_logprob_to_proto(token_id, chosen),
        top_logprobs=[_logprob_to_proto(t, lp) for t, lp in alternatives])


def response_from_output(output: EngineOutput, num_completion_tokens: int) -> engine_pb2.GenerateResponse:
    """One engine delta -> GenerateResponse; ``num_completion_tokens`` is the sequence's running total."""
    response = engine_pb2.GenerateResponse(
        index=output.index, new_token_ids=output.new_token_ids,
        new_logprobs=[position_logprobs_to_proto(p) for p in output.new_logprobs or ()],
        finish_reason=_FINISH_REASON_TO_PROTO[output.finish_reason],
        num_prompt_tokens=output.num_prompt_tokens, num_cached_tokens=output.num_cached_tokens,
        num_completion_tokens=num_completion_tokens)
    if output.stop_reason is not None:
        response.stop_token_id = output.stop_reason
    if output.prompt_logprobs is not None:
        response.prompt_logprobs.SetInParent()  # set even for a one-token prompt (no positions)
        # Position 0 has no logprob (None) and no place on the wire.
        response.prompt_logprobs.positions.extend(
            position_logprobs_to_proto(p) for p in output.prompt_logprobs[1:])
    return response


# ---- the servicer -----------------------------------------------------------------------------


class _GenerateCall:
    """One Generate call's sequences: their running token counts, ends and timing (for metrics)."""

    def __init__(self, n: int, num_prompt_tokens: int, metrics: Optional[EngineMetrics]) -> None:
        self.arrival_time = time.monotonic()
        self.num_prompt_tokens = num_prompt_tokens
        self.metrics = metrics
        self.num_tokens = [0] * n
        self.num_cached_tokens = [0] * n
        self.last_token_time: list[Optional[float]] = [None] * n
        self.first_token_time: list[Optional[float]] = [None] * n
        self.finished = [False] * n

    def response(self, output: EngineOutput) -> engine_pb2.GenerateResponse:
        index, now = output.index, time.monotonic()
        if output.new_token_ids and self.metrics is not None:
            last = self.last_token_time[index]
            if last is None:
                self.metrics.observe_first_token(now - self.arrival_time)
                self.first_token_time[index] = now
                if index == 0:  # the prompt is looked up in the prefix cache once per request
                    self.metrics.observe_prefix_cache(self.num_prompt_tokens, output.num_cached_tokens)
            else:
                self.metrics.observe_token_interval((now - last) / len(output.new_token_ids))
            self.last_token_time[index] = now
        self.num_tokens[index] += len(output.new_token_ids)
        self.num_cached_tokens[index] = output.num_cached_tokens
        if output.finished:
            self._finish(index, output.finish_reason, now)
        return response_from_output(output, self.num_tokens[index])

    def abort_unfinished(self) -> list[engine_pb2.GenerateResponse]:
        """End every unfinished sequence as aborted; their final (token-less) responses."""
        now = time.monotonic()
        responses = []
        for index, finished in enumerate(self.finished):
            if finished:
                continue
            self._finish(index, FinishReason.ABORT, now)
            responses.append(engine_pb2.GenerateResponse(
                index=index, finish_reason=engine_pb2.FINISH_REASON_ABORT,
                num_prompt_tokens=self.num_prompt_tokens, num_cached_tokens=self.num_cached_tokens[index],
                num_completion_tokens=self.num_tokens[index]))
        return responses

    def _finish(self, index: int, reason: FinishReason, now: float) -> None:
        self.finished[index] = True
        if self.metrics is not None:
            self.metrics.observe_finished(now - self.arrival_time, self.num_prompt_tokens,
                                          self.num_tokens[index], reason.value)
            if self.first_token_time[index] is not None:
                self.metrics.observe_decode_time(now - self.first_token_time[index])


async def _until_set(outputs: AsyncIterator[EngineOutput], stop: asyncio.Event) -> AsyncIterator[EngineOutput]:
    """Yield from ``outputs`` until it ends or ``stop`` is set; ``outputs`` is closed either way.

    For an engine stream, closing it before its end aborts the request.
    """
    stop_wait = asyncio.ensure_future(stop.wait())
    next_output: Optional[asyncio.Future] = None
    try:
        while True:
            next_output = asyncio.ensure_future(anext(outputs))
            await asyncio.wait((next_output, stop_wait), return_when=asyncio.FIRST_COMPLETED)
            if not next_output.done():
                return
            try:
                output = next_output.result()
            except StopAsyncIteration:
                return
            yield output
    finally:
        stop_wait.cancel()
        if next_output is not None:
            if not next_output.done():
                # Raises CancelledError inside the stream, whose cleanup aborts the request.
                next_output.cancel()
                await asyncio.wait((next_output,))
            if not next_output.cancelled():
                next_output.exception()  # retrieved: a stream that ended meanwhile is no error
        await outputs.aclose()


def caller_of(context: grpc.aio.ServicerContext) -> object:
    """Who is calling, for Abort's scope: the client certificate's identities under mutual TLS
    (the same frontend on any of its connections), else the connection (its address and port)."""
    identities = context.peer_identities()
    return tuple(identities) if identities else context.peer()


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """EngineService over an engine with the ``EngineClient`` methods (an ``AsyncLLMEngine``).

    Sends the tokenizer files found in ``tokenizer_dir``.
    """

    def __init__(self, engine: AsyncLLMEngine, tokenizer_dir: str, metrics: Optional[EngineMetrics] = None,
                 limits: Optional[Limits] = None, max_num_seqs: int = EngineConfig.max_num_seqs) -> None:
        self.engine = engine
        self.tokenizer_dir = tokenizer_dir
        self.metrics = metrics
        self.limits = limits or Limits()
        # Admission: sequences in flight (running, waiting, being added) may not pass this.
        self.max_sequences_in_flight = max_num_seqs + self.limits.max_num_queued_requests
        self.num_sequences_in_flight = 0
        # Read once: the files are fixed while we serve, and a model without a
        # tokenizer fails here, at startup, rather than on a frontend's first call.
        self._tokenizer_files = tokenizer_file_names(tokenizer_dir)
        self._tokenizer_fingerprint = tokenizer_fingerprint(tokenizer_dir)
        self._version = backend_version()
        self._stop_events: dict[str, asyncio.Event] = {}  # running Generate calls, by request ID
        self._callers: dict[str, object] = {}  # who started each of them (``caller_of``)
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False

    @map_errors
    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        if self._draining:
            raise BackendShuttingDownError("The backend is shutting down; send the request to another one.")
        request_id = request.request_id
        self.limits.check_request_id(request_id)
        if request_id in self._stop_events:  # the engine checks too, but after we registered it
            raise InvalidRequestError(f"Request ID {request_id!r} is already in use.", param="request_id")
        params = sampling_params_from_proto(request.sampling_params)
        self.limits.check_sampling_params(params)  # n is bounded before it counts towards admission
        cache_salt = request.cache_salt if request.HasField("cache_salt") else None
        self.limits.check_cache_salt(cache_salt)
        if self.num_sequences_in_flight + params.n > self.max_sequences_in_flight:
            raise OverloadedError(
                f"The backend is at its limit of {self.max_sequences_in_flight} sequences in flight "
                "(max_num_seqs + --max-num-queued-requests); retry later or on another backend.")
        prompt = list(request.prompt_token_ids)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        call = _GenerateCall(params.n, len(prompt), self.metrics)
        if self.metrics is not None:
            self.metrics.observe_params(params.n, params.max_tokens)
        stop = self._stop_events[request_id] = asyncio.Event()
        self._callers[request_id] = caller_of(context)
        self.num_sequences_in_flight += params.n
        self._idle.clear()
        try:
            stream = self.engine.generate(request_id, prompt, params, deadline=deadline, cache_salt=cache_salt)
            async with contextlib.aclosing(_until_set(stream, stop)) as outputs:
                async for output in outputs:
                    if output.finish_reason == FinishReason.ABORT and deadline is not None \
                            and time.monotonic() >= deadline:  # the engine's own deadline check came first
                        call.abort_unfinished()
                        raise RequestTimeoutError("The call's deadline passed; the engine aborted the request.")
                    await context.write(call.response(output))
            for response in call.abort_unfinished():  # only after Abort: the stream ended early
                await context.write(response)
        except asyncio.CancelledError:
            call.abort_unfinished()  # cancelled or past its deadline: count the ends, send nothing
            raise
        finally:
            if deadline is not None and time.monotonic() >= deadline - DEADLINE_EARLY_CANCEL_S \
                    and self.metrics is not None:
                self.metrics.observe_deadline_expired()
            self.num_sequences_in_flight -= params.n
            del self._stop_events[request_id]
            del self._callers[request_id]
            if not self._stop_events:
                self._idle.set()

    @map_errors
    async def Abort(self, request: engine_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        caller = caller_of(context)
        for request_id in request.request_ids:
            if self._callers.get(request_id) != caller:
                continue  # another caller's request (or none): ignored, as an unknown ID is
            self._stop_events[request_id].set()  # its Generate call sends the ABORT responses and ends OK
            await self.engine.abort(request_id)  # frees the blocks now, not when that call wakes
        return engine_pb2.AbortResponse()

    @map_errors
    async def GetModelInfo(self, request: engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.GetModelInfoResponse:
        info = await self.engine.model_info()
        # Unset bos/pad stay absent (proto optional) rather than becoming token 0.
        return engine_pb2.GetModelInfoResponse(
            model_name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids, bos_token_id=info.bos_token_id,
            pad_token_id=info.pad_token_id, tokenizer_fingerprint=self._tokenizer_fingerprint,
            backend_version=self._version)

    @map_errors
    async def GetTokenizer(self, request: engine_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> None:
        for name in self._tokenizer_files:
            path = os.path.join(self.tokenizer_dir, name)
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                offset = 0
                while True:
                    data = f.read(TOKENIZER_CHUNK_BYTES)
                    await context.write(engine_pb2.GetTokenizerResponse(
                        file_name=name, file_size=size, offset=offset, data=data))
                    offset += len(data)
                    if offset >= size:
                        break

    @map_errors
    async def GetLoad(self, request: engine_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.GetLoadResponse:
        load = await self.engine.get_load()
        return engine_pb2.GetLoadResponse(num_requests_running=load.num_requests_running,
                                          num_requests_waiting=load.num_requests_waiting,
                                          kv_cache_usage=load.kv_cache_usage)

    @map_errors
    async def GetMetrics(self, request: engine_pb2.GetMetricsRequest,
                         context: grpc.aio.ServicerContext) -> engine_pb2.GetMetricsResponse:
        text = generate_latest(self.metrics.registry).decode() if self.metrics is not None else ""
        return engine_pb2.GetMetricsResponse(prometheus_text=text)

    async def drain(self, timeout: float) -> bool:
        """Refuse new Generate calls; wait up to ``timeout`` s for running ones. True if all ended."""
        self._draining = True
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


def backend_version() -> str:
    """The installed Tandem version, else the one in a source checkout's pyproject.toml."""
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
        return re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1)


# ---- the server -------------------------------------------------------------------------------


class BackendServer:
    """A gRPC server around an ``AsyncLLMEngine``: EngineService, health, reflection and metrics.

    Does not own the engine: ``stop()`` leaves it running (``serve`` shuts it down). Health
    tells the truth: NOT_SERVING from the moment the engine dies (``engine_died`` is then set).
    """

    def __init__(self, engine: AsyncLLMEngine, host: str = "127.0.0.1", port: int = 50051,
                 metrics_port: Optional[int] = None, limits: Optional[Limits] = None,
                 max_connection_age: float = DEFAULT_MAX_CONNECTION_AGE_S,
                 security: Optional[ServerSecurity] = None, metrics_host: str = "127.0.0.1") -> None:
        self.engine = engine
        self.host = host
        self.port = port  # the bound port once started (port 0 picks a free one)
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.limits = limits or Limits()
        self.max_connection_age = max_connection_age
        self.security = security or ServerSecurity()
        self.metrics: Optional[EngineMetrics] = None
        self.servicer: Optional[EngineServicer] = None
        self.health = health.aio.HealthServicer()
        self.engine_died = asyncio.Event()
        self._server: Optional[grpc.aio.Server] = None
        self._watcher: Optional[asyncio.Task] = None

    async def start(self) -> None:
        self.security.check_bind(self.host)
        info = await self.engine.model_info()
        self.metrics = EngineMetrics(self.engine.engine, info.model_name)
        self.servicer = EngineServicer(self.engine, info.tokenizer_path, self.metrics, self.limits,
                                       self.engine.engine.config.max_num_seqs)
        message_bytes = self.limits.max_grpc_message_bytes
        # gRPC core cancels (CANCELLED, not RESOURCE_EXHAUSTED) calls that arrive faster than the
        # event loop accepts them once 1,000 (3,000 hard) wait: a burst of thousands of streams
        # lost calls that way. Room for a burst of several times what admission lets in, so the
        # excess reaches admission control and gets its proper answer.
        pending = 4 * self.servicer.max_sequences_in_flight
        options = [("grpc.max_send_message_length", message_bytes),
                   ("grpc.max_receive_message_length", message_bytes),
                   ("grpc.server.max_pending_requests", pending),
                   ("grpc.server.max_pending_requests_hard_limit", pending),
                   # The port is ours alone: gRPC's default SO_REUSEPORT would let a second
                   # server bind it silently and share the traffic.
                   ("grpc.so_reuseport", 0)]
        if self.max_connection_age > 0:
            # Clients reconnect after this long (running streams finish first: the grace is
            # unlimited), so a load balancer or DNS in front sends new connections to new replicas.
            options.append(("grpc.max_connection_age_ms", int(self.max_connection_age * 1000)))
        interceptors = self.security.interceptors(
            on_reject=lambda method: self.metrics.observe_rejected(method, "unauthenticated"))
        grpc_logs.install()
        server = grpc.aio.server(interceptors=interceptors, options=options)
        server.add_generic_rpc_handlers((engine_service_handler(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            server)
        try:
            self.port = self.security.add_port(server, f"{self.host}:{self.port}")
        except RuntimeError:  # gRPC says only "Failed to bind"
            raise port_error(self.host, self.port, "--port") from None
        await server.start()
        self._server = server
        for service in ("", SERVICE_NAME):  # "" is the whole server
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.start_http_server(self.metrics_host, self.metrics_port)
            except OSError as error:
                await self._server.stop(grace=None)
                raise port_error(self.metrics_host, self.metrics_port, "--metrics-port", error) from None
        self._watcher = asyncio.get_running_loop().create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        """Health tells the truth: NOT_SERVING as soon as the engine is dead (a step failed, or a
        worker died: then only ``health()`` may know, hence the poll)."""
        while await self.engine.health():
            try:
                await asyncio.wait_for(self.engine.dead.wait(), ENGINE_HEALTH_POLL_S)
            except asyncio.TimeoutError:
                pass
        logger.error("The engine died (%s): health is NOT_SERVING.", self.engine.dead_error)
        self.metrics.observe_engine_error()
        await self.health.enter_graceful_shutdown()
        self.engine_died.set()

    async def stop(self, timeout: float) -> None:
        """Drain, then stop: NOT_SERVING, refuse new Generate calls, give running streams
        ``timeout`` seconds, cancel what is left (which aborts it in the engine)."""
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING from now on
        if self._watcher is not None:
            self._watcher.cancel()
        if not await self.servicer.drain(timeout):
            logger.warning("Streams still running after %.1f s; cancelling them.", timeout)
        await self._server.stop(grace=None)
        self.metrics.stop_http_server()


async def serve(config: EngineConfig, host: str, port: int, metrics_port: Optional[int],
                shutdown_timeout: float, limits: Optional[Limits] = None,
                max_connection_age: float = DEFAULT_MAX_CONNECTION_AGE_S, security: Optional[ServerSecurity] = None,
                metrics_host: str = "127.0.0.1") -> int:
    """Check the bind and the ports, load the engine, serve until SIGTERM/SIGINT (exit code 0) or
    the engine's death (exit code 1), then drain and stop."""
    security = security or ServerSecurity()
    security.check_bind(host)  # before the model loads, which takes a while
    check_port_free(host, port, "--port")
    if metrics_port is not None:
        check_port_free(metrics_host, metrics_port, "--metrics-port")
    engine = AsyncLLMEngine(config, limits)
    try:
        server = BackendServer(engine, host, port, metrics_port, limits, max_connection_age, security, metrics_host)
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"Backend serving {config.served_model_name} on {host}:{server.port} "
              f"(metrics on port {server.metrics_port})", flush=True)
        stopped, died = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.engine_died.wait())
        await asyncio.wait((stopped, died), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        died.cancel()
        if server.engine_died.is_set():
            print(f"error: the engine stopped after an error: {engine.dead_error}; exiting so that a "
                  "supervisor restarts the backend.", file=sys.stderr, flush=True)
        else:
            logger.info("Shutting down: draining for up to %.1f s.", shutdown_timeout)
        await server.stop(shutdown_timeout)
        return 1 if server.engine_died.is_set() else 0
    finally:
        engine.shutdown()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.server", description=__doc__.splitlines()[0])
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to serve gRPC on; anything but loopback needs --auth-token or mTLS "
                             "(--ssl-ca-certs), or --insecure")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address to serve Prometheus /metrics on")
    parser.add_argument("--metrics-port", type=int, default=8001, help="Prometheus /metrics port")
    security = parser.add_argument_group("security (health stays open; everything else needs the token)")
    security.add_argument("--auth-token", default=os.environ.get(TOKEN_ENV),
                          help=f"require 'authorization: Bearer TOKEN' metadata on every call (default: ${TOKEN_ENV})")
    security.add_argument("--ssl-certfile", default=None, help="serve TLS with this certificate (PEM)")
    security.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    security.add_argument("--ssl-ca-certs", default=None,
                          help="require client certificates signed by this CA (mutual TLS)")
    security.add_argument("--insecure", action="store_true",
                          help="allow a non-loopback --host with neither a token nor mutual TLS")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running streams get to finish after SIGTERM")
    parser.add_argument("--max-connection-age", type=float, default=DEFAULT_MAX_CONNECTION_AGE_S,
                        help="seconds before a client connection is asked to reconnect, so new replicas "
                             "behind a balancer get traffic (running streams finish first; 0: never)")
    Limits.add_cli_args(parser, BACKEND_LIMITS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        security = ServerSecurity(args.auth_token or None, args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs,
                                  args.insecure)  # an empty $TANDEM_GRPC_TOKEN is no token
        return asyncio.run(serve(EngineConfig.from_cli_args(args), args.host, args.port, args.metrics_port,
                                 args.shutdown_timeout, Limits.from_cli_args(args), args.max_connection_age,
                                 security, args.metrics_host))
    except TandemError as error:  # a bad flag or model: say what, without a traceback
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
