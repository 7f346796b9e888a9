"""EngineService over an in-process engine: Generate streams, Abort, model info, tokenizer files.

A Generate call becomes one engine request (proto -> ``SamplingParams``) whose ``EngineOutput``
deltas stream back as ``GenerateResponse``s. However the call ends early (client cancel,
deadline, Abort, server stop), the engine's stream is closed, which aborts the request and frees
its KV blocks at once; a call's deadline also travels into the engine, which aborts the request
when it passes. Admission control: a call whose sequences would take the ones in flight past
``max_num_seqs + --max-num-queued-requests`` is refused at once with RESOURCE_EXHAUSTED.

GenerateStream (``backend.server.generate_stream``) runs many requests on one call through the
same ``request_responses``, so a request behaves the same on either RPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import re
import time
from pathlib import Path
from typing import AsyncIterator, Iterable, Optional

import grpc
from prometheus_client import generate_latest

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.server.generate_stream import GenerateStreamCall
from backend.server.metrics import EngineMetrics
from backend.server.proto_convert import (pooling_params_from_proto, prompt_logprobs_bytes_bound, responses_from_output,
                                          sampling_params_from_proto)
from backend.server.status_codes import BackendShuttingDownError, map_errors, safe_deserializer
from backend.types.bounded_store import BoundedStore
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError, OverloadedError, RequestFailedError, RequestTimeoutError
from backend.types.limits import Limits
from backend.types.outputs import EngineOutput, FinishReason
from backend.types.tokenizer_files import tokenizer_file_names, tokenizer_fingerprint
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
SERVICE_NAME = SERVICE.full_name
TOKENIZER_CHUNK_BYTES = 1024 * 1024  # the proto's per-chunk maximum
# A client's deadline timer starts before ours (we start ours when its headers arrive), so its
# cancel at the deadline reaches us up to a transit time early; an end this close counts as expired.
DEADLINE_EARLY_CANCEL_S = 0.1
# Room a response leaves in a message for what wraps it: GenerateStream's entry (the request ID
# aside, counted per request), its status, and the fields' tags and lengths.
RESPONSE_FRAMING_BYTES = 64


_HANDLER_MAKERS = {  # (client streaming, server streaming) -> grpc's handler maker
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def engine_service_handler(servicer: "EngineServicer") -> grpc.GenericRpcHandler:
    """EngineService's method handlers (the generated ``add_..._to_server``'s, with deserializers
    that hand undecodable bytes to the handler instead of failing the call as UNKNOWN)."""
    handlers = {}
    for method in SERVICE.methods:
        make = _HANDLER_MAKERS[method.client_streaming, method.server_streaming]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=safe_deserializer(getattr(engine_pb2, method.input_type.name)),
            response_serializer=getattr(engine_pb2, method.output_type.name).SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


class _GenerateCall:
    """One Generate call's sequences: their running token counts, ends and timing (for metrics)."""

    def __init__(self, n: int, num_prompt_tokens: int, metrics: Optional[EngineMetrics],
                 max_response_bytes: Optional[int] = None, split_prompt_logprobs: bool = False) -> None:
        self.max_response_bytes = max_response_bytes  # None: responses are never split
        self.split_prompt_logprobs = split_prompt_logprobs  # the client joins split prompt logprobs
        self.arrival_time = time.monotonic()
        self.num_prompt_tokens = num_prompt_tokens
        self.metrics = metrics
        self.num_tokens = [0] * n
        self.num_cached_tokens = [0] * n
        self.last_token_time: list[Optional[float]] = [None] * n
        self.first_token_time: list[Optional[float]] = [None] * n
        self.scheduled_time: list[Optional[float]] = [None] * n  # the engine's first schedule
        self.finished = [False] * n

    def responses(self, output: EngineOutput) -> list[engine_pb2.GenerateResponse]:
        """The delta's response; several when it is larger than a message (``proto_convert``)."""
        index, now = output.index, time.monotonic()
        if output.new_token_ids and self.metrics is not None:
            last = self.last_token_time[index]
            if last is None:
                self.metrics.observe_first_token(now - self.arrival_time)
                self.first_token_time[index] = now
                if output.scheduled_time is not None:
                    self.scheduled_time[index] = output.scheduled_time
                    self.metrics.observe_scheduled(max(output.scheduled_time - self.arrival_time, 0.0),
                                                   max(now - output.scheduled_time, 0.0))
                if index == 0:  # the prompt is looked up in the prefix cache once per request
                    self.metrics.observe_prefix_cache(self.num_prompt_tokens, output.num_cached_tokens)
            else:
                self.metrics.observe_token_interval((now - last) / len(output.new_token_ids))
            self.last_token_time[index] = now
        self.num_tokens[index] += len(output.new_token_ids)
        self.num_cached_tokens[index] = output.num_cached_tokens
        if output.finished:
            self._finish(index, output.finish_reason, now)
        return responses_from_output(output, self.num_tokens[index], self.max_response_bytes,
                                     self.split_prompt_logprobs)

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
            if self.scheduled_time[index] is not None:
                self.metrics.observe_inference_time(max(now - self.scheduled_time[index], 0.0))


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
        # The Responses API's stored responses (payloads opaque here), for any frontend.
        self._stored_responses: BoundedStore[bytes] = BoundedStore(
            self.limits.max_stored_responses, self.limits.max_stored_response_bytes,
            self.limits.max_stored_response_age_s)

    @map_errors
    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        async with contextlib.aclosing(self.request_responses(request, deadline, caller_of(context))) as responses:
            async for response in responses:
                await context.write(response)

    @map_errors
    async def GenerateStream(self, requests: AsyncIterator[engine_pb2.GenerateStreamRequest],
                             context: grpc.aio.ServicerContext) -> None:
        await GenerateStreamCall(self, context, caller_of(context)).serve(requests)

    async def request_responses(self, request: engine_pb2.GenerateRequest, deadline: Optional[float],
                                caller: object) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """One request's responses, as its Generate call sends them; raises what ends the call.

        ``deadline``: ``time.monotonic()`` seconds, or None. Closing the iterator early (a cancelled
        call, a passed deadline) aborts the request in the engine and counts its sequences' ends.
        """
        if self._draining:
            raise BackendShuttingDownError("The backend is shutting down; send the request to another one.")
        request_id = request.request_id
        self.limits.check_request_id(request_id)
        if request_id in self._stop_events:  # the engine checks too, but after we registered it
            raise InvalidRequestError(f"Request ID {request_id!r} is already in use.", param="request_id")
        params = sampling_params_from_proto(request.sampling_params)
        self.limits.check_sampling_params(params, None)  # n is bounded before it counts towards admission
        cache_salt = request.cache_salt if request.HasField("cache_salt") else None
        self.limits.check_cache_salt(cache_salt)
        if self.num_sequences_in_flight + params.n > self.max_sequences_in_flight:
            raise OverloadedError(
                f"The backend is at its limit of {self.max_sequences_in_flight} sequences in flight "
                "(max_num_seqs + --max-num-queued-requests); retry later or on another backend.")
        prompt = list(request.prompt_token_ids)
        # The largest response that fits one message of either RPC, its request ID included.
        max_response_bytes = (self.limits.max_grpc_message_bytes - RESPONSE_FRAMING_BYTES
                              - len(request_id.encode()))
        if params.prompt_logprobs is not None and not request.accept_split_prompt_logprobs:
            await self._check_prompt_logprobs_fit(len(prompt), params.prompt_logprobs, max_response_bytes)
        call = _GenerateCall(params.n, len(prompt), self.metrics, max_response_bytes,
                             request.accept_split_prompt_logprobs)
        if self.metrics is not None:
            self.metrics.observe_params(params.n, params.max_tokens)
        stop = self._stop_events[request_id] = asyncio.Event()
        self._callers[request_id] = caller
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
                    for response in call.responses(output):
                        yield response
            for response in call.abort_unfinished():  # only after Abort: the stream ended early
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            # Cancelled or past its deadline (while in the engine, or while its caller wrote):
            # count the ends, send nothing.
            call.abort_unfinished()
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

    async def _check_prompt_logprobs_fit(self, num_prompt_tokens: int, prompt_logprobs: int,
                                         max_response_bytes: int) -> None:
        """For a client that cannot join split prompt logprobs: refuse, before the request runs, one
        whose prompt logprobs might not fit one message (else its call would fail once they came)."""
        vocab_size = (await self.engine.model_info()).vocab_size
        bound = prompt_logprobs_bytes_bound(num_prompt_tokens, prompt_logprobs, vocab_size)
        if bound > max_response_bytes:
            raise InvalidRequestError(
                f"prompt_logprobs={prompt_logprobs} over {num_prompt_tokens} prompt tokens may take up to {bound} "
                f"bytes, more than one gRPC message holds (--max-grpc-message-bytes "
                f"{self.limits.max_grpc_message_bytes}); ask for fewer, or set "
                "GenerateRequest.accept_split_prompt_logprobs to receive them split over several responses.",
                param="prompt_logprobs")

    @map_errors
    async def Embed(self, request: engine_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.EmbedResponse:
        """One prompt's pooled hidden state. Admitted, bounded and drained as a one-sequence
        Generate call; a cancelled call (or its deadline) aborts it in the engine. Abort ignores
        it (a unary call is stopped by cancelling it)."""
        if self._draining:
            raise BackendShuttingDownError("The backend is shutting down; send the request to another one.")
        request_id = request.request_id
        self.limits.check_request_id(request_id)
        if request_id in self._stop_events:
            raise InvalidRequestError(f"Request ID {request_id!r} is already in use.", param="request_id")
        pooling = pooling_params_from_proto(request)
        if self.num_sequences_in_flight + 1 > self.max_sequences_in_flight:
            raise OverloadedError(
                f"The backend is at its limit of {self.max_sequences_in_flight} sequences in flight "
                "(max_num_seqs + --max-num-queued-requests); retry later or on another backend.")
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        prompt = list(request.prompt_token_ids)
        self._stop_events[request_id] = asyncio.Event()  # the ID is taken; no caller: Abort skips it
        self.num_sequences_in_flight += 1
        self._idle.clear()
        try:
            embedding = await self.engine.embed(request_id, prompt, pooling, deadline=deadline)
        except RequestFailedError:
            if deadline is not None and time.monotonic() >= deadline - DEADLINE_EARLY_CANCEL_S:
                raise RequestTimeoutError("The call's deadline passed; the engine aborted the request.") from None
            raise
        finally:
            self.num_sequences_in_flight -= 1
            del self._stop_events[request_id]
            if not self._stop_events:
                self._idle.set()
        return engine_pb2.EmbedResponse(embedding=embedding, num_prompt_tokens=len(prompt))

    @map_errors
    async def Abort(self, request: engine_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        await self.abort_requests(request.request_ids, caller_of(context))
        return engine_pb2.AbortResponse()

    async def abort_requests(self, request_ids: Iterable[str], caller: object) -> None:
        """Stop ``caller``'s requests among ``request_ids``; other callers' and unknown IDs are ignored."""
        for request_id in request_ids:
            if self._callers.get(request_id) != caller:
                continue  # another caller's request (or none): ignored, as an unknown ID is
            self._stop_events[request_id].set()  # its call sends the ABORT responses and ends OK
            await self.engine.abort(request_id)  # frees the blocks now, not when that call wakes

    @map_errors
    async def GetModelInfo(self, request: engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.GetModelInfoResponse:
        info = await self.engine.model_info()
        # Unset bos/pad stay absent (proto optional) rather than becoming token 0.
        return engine_pb2.GetModelInfoResponse(
            model_name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids, bos_token_id=info.bos_token_id,
            pad_token_id=info.pad_token_id, tokenizer_fingerprint=self._tokenizer_fingerprint,
            backend_version=self._version, hidden_size=info.hidden_size or 0)

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

    # ---- stored responses (the payloads are the frontends') ----

    def _check_response_id(self, response_id: str) -> None:
        if not response_id:
            raise InvalidRequestError("response_id must not be empty.", param="response_id")
        if len(response_id) > self.limits.max_request_id_length:
            raise InvalidRequestError(f"response_id must be at most {self.limits.max_request_id_length} characters "
                                      "(the server's --max-request-id-length).", param="response_id")

    @map_errors
    async def PutStoredResponse(self, request: engine_pb2.PutStoredResponseRequest,
                                context: grpc.aio.ServicerContext) -> engine_pb2.PutStoredResponseResponse:
        self._check_response_id(request.response_id)
        stored = self._stored_responses.put(request.response_id, request.payload, len(request.payload))
        return engine_pb2.PutStoredResponseResponse(stored=stored)

    @map_errors
    async def GetStoredResponse(self, request: engine_pb2.GetStoredResponseRequest,
                                context: grpc.aio.ServicerContext) -> engine_pb2.GetStoredResponseResponse:
        self._check_response_id(request.response_id)
        payload = self._stored_responses.get(request.response_id)
        return engine_pb2.GetStoredResponseResponse(found=payload is not None, payload=payload or b"")

    @map_errors
    async def DeleteStoredResponse(self, request: engine_pb2.DeleteStoredResponseRequest,
                                   context: grpc.aio.ServicerContext) -> engine_pb2.DeleteStoredResponseResponse:
        self._check_response_id(request.response_id)
        return engine_pb2.DeleteStoredResponseResponse(deleted=self._stored_responses.delete(request.response_id))

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
        pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
        return re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1)
