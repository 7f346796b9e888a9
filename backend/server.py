"""The backend's gRPC server: EngineService over an in-process engine, plus health, reflection, metrics.

    python -m backend.server [MODEL] --host 0.0.0.0 --port 50051 --metrics-port 8001 [engine flags]

A Generate call becomes one engine request (proto -> ``SamplingParams``) whose
``EngineOutput`` deltas stream back as ``GenerateResponse``s. However the call
ends early (client cancel, deadline, Abort, server stop), the engine's stream
is closed, which aborts the request and frees its KV blocks at once.
Exceptions become status codes in one place, ``map_errors``.

On SIGTERM/SIGINT the server drains: health turns NOT_SERVING, new Generate
calls get UNAVAILABLE, running streams get ``--shutdown-timeout`` seconds to
finish and are then cancelled; the process exits 0.
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

from backend.config import EngineConfig
from backend.engine import AsyncLLMEngine
from backend.errors import EngineDeadError, InvalidRequestError, TandemError
from backend.metrics import EngineMetrics
from backend.ports import check_port_free, port_error
from backend.request import (EngineOutput, FinishReason, Logprob, PositionLogprobs, SamplingParams,
                             StructuredOutputsParams)
from backend.tokenizer_files import tokenizer_file_names, tokenizer_fingerprint
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
# Explicit, so a big tokenizer chunk or prompt never meets gRPC's 4 MiB receive default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
TOKENIZER_CHUNK_BYTES = 1024 * 1024  # the proto's per-chunk maximum
ERROR_PARAM_METADATA_KEY = "tandem-error-param"
DEFAULT_MAX_CONNECTION_AGE_S = 300.0
ENGINE_HEALTH_POLL_S = 0.5

_FINISH_REASON_TO_PROTO = {
    None: engine_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: engine_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: engine_pb2.FINISH_REASON_ABORT,
}


class BackendShuttingDownError(TandemError):
    """The server is draining before it stops; send the request to another backend."""


# ---- errors -> status codes (the one place) -----------------------------------------------

_STATUS_OF_ERROR: tuple[tuple[type[TandemError], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (BackendShuttingDownError, grpc.StatusCode.UNAVAILABLE),
)

Handler = Callable[["EngineServicer", object, grpc.aio.ServicerContext], Awaitable[object]]


def map_errors(handler: Handler) -> Handler:
    """End the call with the status code of the typed error the handler raised.

    Handlers are coroutines (streams use ``context.write``), so every call ends
    inside the handler and its ``finally`` blocks run at once on cancellation.
    Errors not listed in ``_STATUS_OF_ERROR`` propagate (gRPC reports UNKNOWN).
    """

    @functools.wraps(handler)
    async def handle(self: "EngineServicer", request: object, context: grpc.aio.ServicerContext) -> object:
        try:
            return await handler(self, request, context)
        except TandemError as error:
            code = next((code for kind, code in _STATUS_OF_ERROR if isinstance(error, kind)), None)
            if code is None:
                raise
            param = getattr(error, "param", None)
            await context.abort(code, str(error),
                                trailing_metadata=((ERROR_PARAM_METADATA_KEY, param),) if param else ())

    return handle


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
        if next_output is not None and not next_output.done():
            # Raises CancelledError inside the stream, whose cleanup aborts the request.
            next_output.cancel()
            await asyncio.wait((next_output,))
        await outputs.aclose()


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """EngineService over an engine with the ``EngineClient`` methods (an ``AsyncLLMEngine``).

    Sends the tokenizer files found in ``tokenizer_dir``.
    """

    def __init__(self, engine: AsyncLLMEngine, tokenizer_dir: str,
                 metrics: Optional[EngineMetrics] = None) -> None:
        self.engine = engine
        self.tokenizer_dir = tokenizer_dir
        self.metrics = metrics
        # Read once: the files are fixed while we serve, and a model without a
        # tokenizer fails here, at startup, rather than on a frontend's first call.
        self._tokenizer_files = tokenizer_file_names(tokenizer_dir)
        self._tokenizer_fingerprint = tokenizer_fingerprint(tokenizer_dir)
        self._version = backend_version()
        self._stop_events: dict[str, asyncio.Event] = {}  # running Generate calls, by request ID
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False

    @map_errors
    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        if self._draining:
            raise BackendShuttingDownError("The backend is shutting down; send the request to another one.")
        request_id = request.request_id
        if not request_id:
            raise InvalidRequestError("request_id must not be empty.", param="request_id")
        if request_id in self._stop_events:  # the engine checks too, but after we registered it
            raise InvalidRequestError(f"Request ID {request_id!r} is already in use.", param="request_id")
        params = sampling_params_from_proto(request.sampling_params)
        prompt = list(request.prompt_token_ids)
        call = _GenerateCall(params.n, len(prompt), self.metrics)
        if self.metrics is not None:
            self.metrics.observe_params(params.n, params.max_tokens)
        stop = self._stop_events[request_id] = asyncio.Event()
        self._idle.clear()
        try:
            async with contextlib.aclosing(_until_set(self.engine.generate(request_id, prompt, params),
                                                      stop)) as outputs:
                async for output in outputs:
                    await context.write(call.response(output))
            for response in call.abort_unfinished():  # only after Abort: the stream ended early
                await context.write(response)
        except asyncio.CancelledError:
            call.abort_unfinished()  # cancelled or past its deadline: count the ends, send nothing
            raise
        finally:
            del self._stop_events[request_id]
            if not self._stop_events:
                self._idle.set()

    @map_errors
    async def Abort(self, request: engine_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        for request_id in request.request_ids:
            stop = self._stop_events.get(request_id)
            if stop is not None:
                stop.set()  # its Generate call sends the ABORT responses and ends OK
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

    Does not own the engine: ``stop()`` leaves it running (``serve`` shuts it down).
    """

    def __init__(self, engine: AsyncLLMEngine, host: str = "0.0.0.0", port: int = 50051,
                 metrics_port: Optional[int] = None,
                 max_connection_age: float = DEFAULT_MAX_CONNECTION_AGE_S) -> None:
        self.engine = engine
        self.host = host
        self.port = port  # the bound port once started (port 0 picks a free one)
        self.metrics_port = metrics_port
        self.max_connection_age = max_connection_age
        self.metrics: Optional[EngineMetrics] = None
        self.servicer: Optional[EngineServicer] = None
        self.health = health.aio.HealthServicer()
        self._server: Optional[grpc.aio.Server] = None
        self._watcher: Optional[asyncio.Task] = None

    async def start(self) -> None:
        info = await self.engine.model_info()
        self.metrics = EngineMetrics(self.engine.engine, info.model_name)
        self.servicer = EngineServicer(self.engine, info.tokenizer_path, self.metrics)
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   # The port is ours alone: gRPC's default SO_REUSEPORT would let a second
                   # server bind it silently and share the traffic.
                   ("grpc.so_reuseport", 0)]
        if self.max_connection_age > 0:
            # Clients reconnect after this long (running streams finish first: the grace is
            # unlimited), so a load balancer or DNS in front sends new connections to new replicas.
            options.append(("grpc.max_connection_age_ms", int(self.max_connection_age * 1000)))
        server = grpc.aio.server(options=options)
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            server)
        try:
            self.port = server.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError:  # gRPC says only "Failed to bind"
            raise port_error(self.host, self.port, "--port") from None
        await server.start()
        self._server = server
        for service in ("", SERVICE_NAME):  # "" is the whole server
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.start_http_server(self.host, self.metrics_port)
            except OSError as error:
                await self._server.stop(grace=None)
                raise port_error(self.host, self.metrics_port, "--metrics-port", error) from None
        self._watcher = asyncio.get_running_loop().create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        """Health tells the truth: NOT_SERVING as soon as the engine is dead (e.g. a worker died)."""
        while await self.engine.health():
            await asyncio.sleep(ENGINE_HEALTH_POLL_S)
        logger.error("The engine is dead (%s); health is NOT_SERVING.", self.engine.dead_error)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, timeout: float) -> None:
        """Drain, then stop: NOT_SERVING, refuse new Generate calls, give running streams
        ``timeout`` seconds, cancel what is left (which aborts it in the engine)."""
        if self._watcher is not None:
            self._watcher.cancel()
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING from now on
        if not await self.servicer.drain(timeout):
            logger.warning("Streams still running after %.1f s; cancelling them.", timeout)
        await self._server.stop(grace=None)
        self.metrics.stop_http_server()


async def serve(config: EngineConfig, host: str, port: int, metrics_port: Optional[int],
                shutdown_timeout: float, max_connection_age: float = DEFAULT_MAX_CONNECTION_AGE_S) -> None:
    """Check the ports, load the engine, serve until SIGTERM/SIGINT, then drain and stop."""
    check_port_free(host, port, "--port")  # before the model loads, which takes a while
    if metrics_port is not None:
        check_port_free(host, metrics_port, "--metrics-port")
    engine = AsyncLLMEngine(config)
    try:
        server = BackendServer(engine, host, port, metrics_port, max_connection_age)
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"Backend serving {config.served_model_name} on {host}:{server.port} "
              f"(metrics on port {server.metrics_port})", flush=True)
        await stop.wait()
        logger.info("Shutting down: draining for up to %.1f s.", shutdown_timeout)
        await server.stop(shutdown_timeout)
    finally:
        engine.shutdown()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.server", description=__doc__.splitlines()[0])
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--host", default="0.0.0.0", help="address to bind gRPC and metrics to")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=8001, help="Prometheus /metrics port")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running streams get to finish after SIGTERM")
    parser.add_argument("--max-connection-age", type=float, default=DEFAULT_MAX_CONNECTION_AGE_S,
                        help="seconds before a client connection is asked to reconnect, so new replicas "
                             "behind a balancer get traffic (running streams finish first; 0: never)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(EngineConfig.from_cli_args(args), args.host, args.port, args.metrics_port,
                          args.shutdown_timeout, args.max_connection_age))
    except TandemError as error:  # a bad flag or model: say what, without a traceback
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
