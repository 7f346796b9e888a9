"""GrpcEngineClient: the ``EngineClient`` of a backend reached over gRPC (torch-free).

It speaks ``protos/tandem/engine/v1/engine.proto``: SamplingParams go out as
the proto's message, GenerateResponses come back as ``EngineOutput`` deltas,
and status codes become typed errors (``error_from_status``, the one place; the message
conversions live in ``frontend.proto_convert``):

    INVALID_ARGUMENT    -> InvalidRequestError (param from ``tandem-error-param``)
    RESOURCE_EXHAUSTED  -> BackendOverloadedError
    UNAUTHENTICATED     -> BackendCredentialsError (its message names the flag to fix)
    UNAVAILABLE         -> BackendUnavailableError (also: connection refused,
                           a unary call past its deadline); a failed TLS
                           handshake: BackendCredentialsError
    DEADLINE_EXCEEDED   -> RequestTimeoutError (a Generate call past its deadline)
    anything else       -> BackendError

Requests go on one GenerateStream call per backend (``frontend.multiplexed_stream``): many
requests' deltas arrive in one message per engine step. A backend without that RPC
(UNIMPLEMENTED) gets Generate calls instead, one per request; so does a request too big for one
message. The call is replaced every ``STREAM_MAX_AGE_S`` so that a backend's connection ageing
(``--max-connection-age``) and DNS changes still move the traffic.

Health tells the truth across restarts: whenever the channel has been down
and comes back, the backend's tokenizer fingerprint is checked again before
the next request goes out; a backend that came back with another tokenizer
is refused (health False, requests BackendUnavailableError) until one with
the expected tokenizer answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import aclosing
from pathlib import Path
from typing import AsyncIterator, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from backend.types.errors import (EngineDeadError, InvalidRequestError, OverloadedError, RequestFailedError,
                                  RequestTimeoutError, TandemError)
from backend.types.limits import Limits
from backend.types.outputs import EngineLoad, EngineOutput, ModelInfo
from backend.types.pooling import PoolingParams
from backend.types.sampling_params import SamplingParams
from backend.types.wire import ERROR_PARAM_METADATA_KEY, TOKEN_ENV
from frontend.channel_security import ChannelSecurity  # noqa: F401 -- part of this module's API
from frontend.multiplexed_stream import MultiplexedStream, StreamBroken, StreamUnsupported
from frontend.proto_convert import OutputReader, sampling_params_to_proto
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

UNARY_TIMEOUT_S = 30.0  # a backend that does not answer a unary call by then counts as unavailable
HEALTH_TIMEOUT_S = 1.0
_POOLING_TYPES = {"last": engine_pb2.POOLING_TYPE_LAST, "mean": engine_pb2.POOLING_TYPE_MEAN,
                  "cls": engine_pb2.POOLING_TYPE_CLS}
# Reconnect within about a second of a restarted backend coming back (gRPC's default backoff
# grows to two minutes, so a restarted backend would sit unused).
RECONNECT_BACKOFF_MS = (100, 1000)  # initial, maximum
CLOSED_AT_ONCE_LOG_INTERVAL_S = 10.0  # how often a backend that drops every connection is reported
STREAM_MAX_AGE_S = 60.0  # a GenerateStream call takes new requests this long, then ends once they have



class BackendError(TandemError, RuntimeError):
    """The backend failed a call for a reason other than those below; ``code`` is the gRPC status."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(message)
        self.code = code


class BackendUnavailableError(EngineDeadError):
    """The backend cannot be reached, is shutting down or its engine is dead (HTTP 503)."""


class BackendOverloadedError(OverloadedError):
    """The backend's waiting queue is full; retry later or elsewhere (HTTP 429)."""


class BackendCredentialsError(BackendUnavailableError, BackendError):
    """The backend refuses this frontend's credentials: a wrong or missing token (UNAUTHENTICATED) or
    a TLS handshake that failed. Retrying will not help until a flag changes; the message names it
    (HTTP 503 to clients)."""


TOKEN_HINT = (f"give the frontend the backend's --auth-token with --backend-auth-token (or ${TOKEN_ENV}); "
              "it is missing or differs")
TLS_HINT = ("check --backend-ssl-ca-certs (the CA that signed the backend's certificate), "
            "--backend-ssl-server-name, and --backend-ssl-certfile/--backend-ssl-keyfile (mutual TLS) against the "
            "backend's --ssl-* flags; a backend without TLS needs none of them")


def error_from_status(error: grpc.aio.AioRpcError) -> TandemError:
    """The typed error for a failed call."""
    param = None
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        param = dict(error.trailing_metadata() or ()).get(ERROR_PARAM_METADATA_KEY)
    return error_from_code(error.code(), error.details(), param)


def error_from_code(code: grpc.StatusCode, message: Optional[str], param: Optional[str] = None) -> TandemError:
    """The typed error for a status: a failed call's, or a GenerateStream request's end."""
    message = message or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(message, param=param)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return BackendCredentialsError(f"The backend refused this frontend's credentials (UNAUTHENTICATED: "
                                       f"{message}): {TOKEN_HINT}.", code)
    if code == grpc.StatusCode.UNAVAILABLE and "handshake failed" in message.lower():
        return BackendCredentialsError(f"TLS with the backend failed ({message}): {TLS_HINT}.", code)
    if code == grpc.StatusCode.UNAVAILABLE:
        return BackendUnavailableError(f"Backend unavailable: {message}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestTimeoutError(f"The request did not finish before its deadline ({message}).")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return BackendOverloadedError(message)
    if code == grpc.StatusCode.INTERNAL:  # this request failed inside the backend; the backend goes on
        return RequestFailedError(message)
    return BackendError(f"Backend call failed ({code.name}): {message}", code)


# ---- the client ----------------------------------------------------------------------------


class GrpcEngineClient:
    """``EngineClient`` over a backend's gRPC address (``host:port``).

    The channel is opened on first use, inside the running event loop (a
    ``grpc.aio`` channel belongs to the loop that created it). After
    ``expect_tokenizer(fingerprint)``, every (re)connection is checked against
    that fingerprint before requests use it. ``multiplexed=False`` sends every request with
    Generate (for comparison; the default multiplexes them on GenerateStream).
    """

    def __init__(self, address: str, limits: Optional[Limits] = None,
                 security: Optional[ChannelSecurity] = None, multiplexed: bool = True) -> None:
        self.address = address
        self.limits = limits or Limits()
        self.security = security or ChannelSecurity()
        self.multiplexed = multiplexed
        self._streams: list[MultiplexedStream] = []  # the open one last; older ones until their requests end
        self._stream_supported: Optional[bool] = None  # None: not known for the backend now reached
        self._metadata = self.security.metadata
        self._channel: Optional[grpc.aio.Channel] = None
        self._stub: Optional[engine_pb2_grpc.EngineServiceStub] = None
        self._health: Optional[health_pb2_grpc.HealthStub] = None
        self._watcher: Optional[asyncio.Task] = None
        self._expected_fingerprint: Optional[str] = None
        self._verified = False  # the current connection's backend has the expected tokenizer
        self._verifying: Optional[asyncio.Future] = None
        self._mismatch: Optional[str] = None  # why the last check refused the backend
        self._closed_at_once_logged = -float("inf")  # when a connection dropped at once was last reported

    def _connect(self) -> None:
        if self._channel is None:
            message_bytes = self.limits.max_grpc_message_bytes
            self._channel = self.security.channel(
                self.address, options=[("grpc.max_send_message_length", message_bytes),
                                       ("grpc.max_receive_message_length", message_bytes),
                                       ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                                       ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                                       ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1])])
            self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
            self._watcher = asyncio.get_running_loop().create_task(self._watch_connectivity())

    @property
    def _engine(self) -> engine_pb2_grpc.EngineServiceStub:
        self._connect()
        return self._stub

    # ---- the tokenizer check on every reconnection ----

    def expect_tokenizer(self, fingerprint: str) -> None:
        """From now on, refuse a backend whose tokenizer fingerprint differs from ``fingerprint``."""
        self._expected_fingerprint = fingerprint

    async def _watch_connectivity(self) -> None:
        """Forget the check whenever the channel leaves READY: what answers next may be another process."""
        state = self._channel.get_state(try_to_connect=False)
        while True:
            if state != grpc.ChannelConnectivity.READY:
                self._verified = False
                self._stream_supported = None  # what answers next may be another version
            await self._channel.wait_for_state_change(state)
            state = self._channel.get_state(try_to_connect=False)

    async def _check_backend(self) -> None:
        """Raise BackendUnavailableError unless the backend now reached has the expected tokenizer."""
        self._connect()
        if self._expected_fingerprint is None or self._verified:
            if self._mismatch is not None:
                raise BackendUnavailableError(self._mismatch)
            return
        if self._verifying is None:  # one check at a time; concurrent requests share it
            self._verifying = asyncio.ensure_future(self._verify())
        try:
            await asyncio.shield(self._verifying)
        finally:
            if self._verifying is not None and self._verifying.done():
                self._verifying = None
        if self._mismatch is not None:
            raise BackendUnavailableError(self._mismatch)

    async def _verify(self) -> None:
        fingerprint = await self.tokenizer_fingerprint()
        if fingerprint == self._expected_fingerprint:
            self._mismatch = None
        else:
            self._mismatch = (
                f"The backend at {self.address} now serves a different tokenizer (fingerprint {fingerprint[:16]}, "
                f"expected {self._expected_fingerprint[:16]}): refusing it until one with the expected tokenizer "
                "answers; restart this frontend to follow the new one.")
            logger.error("%s", self._mismatch)
        self._verified = True

    # ---- EngineClient ----

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       deadline: Optional[float] = None,
                       cache_salt: Optional[str] = None) -> AsyncIterator[EngineOutput]:
        """Stream the request's deltas. Closing the iterator early (or cancelling the
        task) cancels the call, which aborts the request on the backend. ``deadline``
        (``time.monotonic()`` seconds) becomes the call's gRPC deadline."""
        try:
            request = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                                 sampling_params=sampling_params_to_proto(params),
                                                 cache_salt=cache_salt, accept_split_prompt_logprobs=True)
        except ValueError as error:  # e.g. a negative token ID, which uint32 cannot hold
            raise InvalidRequestError(f"The request cannot be sent to the backend: {error}") from None
        await self._check_backend()
        stream = self._stream_for(request)
        if stream is not None:
            try:
                async with aclosing(stream.generate(request, deadline)) as outputs:  # closed with this one
                    async for output in outputs:
                        yield output
                return
            except StreamUnsupported:  # nothing ran; Generate serves it, and what follows
                if self._stream_supported is not False:
                    logger.info("The backend at %s has no GenerateStream (an older version): one Generate "
                                "call per request.", self.address)
                self._stream_supported = False
            except StreamBroken as error:  # nothing came out; Generate gets the backend's real status
                logger.debug("GenerateStream to %s broke (%s); request %s goes by Generate.", self.address,
                             error, request_id)
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        call = self._engine.Generate(request, timeout=timeout, metadata=self._metadata)
        reader = OutputReader(request_id)
        try:
            async for response in call:
                output = reader.read(response)
                if output is not None:
                    yield output
        except grpc.aio.AioRpcError as error:
            raise error_from_status(error) from None
        finally:
            call.cancel()  # a no-op once the stream has ended

    def _stream_for(self, request: engine_pb2.GenerateRequest) -> Optional[MultiplexedStream]:
        """The GenerateStream call for a request (opened or replaced if need be), or None: Generate."""
        if not self.multiplexed or self._stream_supported is False:
            return None
        self._streams = [stream for stream in self._streams if not stream.ended]
        current = self._streams[-1] if self._streams else None
        if current is not None and current.open and time.monotonic() - current.opened_at > STREAM_MAX_AGE_S:
            current.half_close()
        if current is None or not current.open:
            current = MultiplexedStream(self._engine, self._metadata, self.limits.max_grpc_message_bytes,
                                        error_from_code, error_from_status, OutputReader)
            self._streams.append(current)
        return current if current.fits(request) else None

    async def embed(self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams, *,
                    deadline: Optional[float] = None) -> list[float]:
        """One prompt's pooled hidden state (the Embed RPC); ``deadline`` as ``generate``'s."""
        try:
            request = engine_pb2.EmbedRequest(
                request_id=request_id, prompt_token_ids=prompt_token_ids, normalize=pooling.normalize,
                pooling_type=_POOLING_TYPES[pooling.type])
        except ValueError as error:  # e.g. a negative token ID, which uint32 cannot hold
            raise InvalidRequestError(f"The request cannot be sent to the backend: {error}") from None
        await self._check_backend()
        timeout = UNARY_TIMEOUT_S if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            response = await self._engine.Embed(request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            raise error_from_status(error) from None
        return list(response.embedding)

    async def abort(self, request_id: str) -> None:
        for stream in self._streams:
            if stream.has(request_id):
                stream.abort(request_id)
                return
        await self._unary(self._engine.Abort, engine_pb2.AbortRequest(request_ids=[request_id]))

    async def model_info(self) -> ModelInfo:
        info = await self._unary(self._engine.GetModelInfo, engine_pb2.GetModelInfoRequest())
        return ModelInfo(
            model_name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            bos_token_id=info.bos_token_id if info.HasField("bos_token_id") else None,
            pad_token_id=info.pad_token_id if info.HasField("pad_token_id") else None,
            hidden_size=info.hidden_size or None)

    async def tokenizer_fingerprint(self) -> str:
        """The backend's tokenizer fingerprint (``backend.types.tokenizer_files.tokenizer_fingerprint``)."""
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
        """True when the backend answers SERVING within ``HEALTH_TIMEOUT_S`` and has the expected
        tokenizer; False otherwise. Raises ``BackendCredentialsError`` when it refuses this
        frontend's token or TLS settings: unlike an outage, that does not pass by itself."""
        self._connect()
        try:
            response = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S,
                                                metadata=self._metadata)
            if response.status != health_pb2.HealthCheckResponse.SERVING:
                return False
            await asyncio.wait_for(self._check_backend(), HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            failure = error_from_status(error)
            if isinstance(failure, BackendCredentialsError):
                raise failure from None
            self._report_closed_at_once(error)
            return False
        except BackendCredentialsError:
            raise
        except (TandemError, asyncio.TimeoutError):
            return False
        return True

    def _report_closed_at_once(self, error: grpc.aio.AioRpcError) -> None:
        """Warn (every ``CLOSED_AT_ONCE_LOG_INTERVAL_S``) when the backend drops each connection as
        soon as it opens: what a TLS backend does to a plaintext client, or a mutual-TLS one to a
        client without a certificate. It could also be a passing fault, so this only warns."""
        if "socket closed" not in (error.details() or "").lower():
            return
        now = time.monotonic()
        if now - self._closed_at_once_logged < CLOSED_AT_ONCE_LOG_INTERVAL_S:
            return
        self._closed_at_once_logged = now
        if not self.security.ssl_ca_certs:
            hint = ("if it serves TLS, give --backend-ssl-ca-certs (and --backend-ssl-certfile/--backend-ssl-keyfile "
                    "if it requires client certificates)")
        elif not self.security.ssl_certfile:
            hint = "if it requires client certificates (mutual TLS), give --backend-ssl-certfile/--backend-ssl-keyfile"
        else:
            hint = "check that the CA of the backend's --ssl-ca-certs signed --backend-ssl-certfile"
        logger.warning("The backend at %s closes each connection as soon as it opens (%s): %s.", self.address,
                       error.details(), hint)

    async def fetch_tokenizer(self, dest_dir: str | os.PathLike) -> Path:
        """Write the backend's tokenizer files into ``dest_dir`` (created if needed); return it.

        Files are written only once all have arrived whole. Raises ``BackendError``
        for a file name that could escape ``dest_dir`` or chunks that do not add
        up to the announced file size.
        """
        files: dict[str, bytearray] = {}
        sizes: dict[str, int] = {}
        call = self._engine.GetTokenizer(engine_pb2.GetTokenizerRequest(), timeout=UNARY_TIMEOUT_S,
                                         metadata=self._metadata)
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
        streams, self._streams = self._streams, []
        await asyncio.gather(*(stream.close() for stream in streams))
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # ---- stored responses (kept by the backend for any frontend; the payload is ours) ----

    async def put_stored_response(self, response_id: str, payload: bytes) -> bool:
        """Keep ``payload`` under ``response_id`` on this backend; False if it exceeds the store's bound."""
        response = await self._unary(self._engine.PutStoredResponse,
                                     engine_pb2.PutStoredResponseRequest(response_id=response_id, payload=payload))
        return response.stored

    async def get_stored_response(self, response_id: str) -> Optional[bytes]:
        """The payload this backend keeps under ``response_id``, or None."""
        response = await self._unary(self._engine.GetStoredResponse,
                                     engine_pb2.GetStoredResponseRequest(response_id=response_id))
        return response.payload if response.found else None

    async def delete_stored_response(self, response_id: str) -> bool:
        """Forget ``response_id`` on this backend; False if it did not hold it."""
        response = await self._unary(self._engine.DeleteStoredResponse,
                                     engine_pb2.DeleteStoredResponseRequest(response_id=response_id))
        return response.deleted

    async def _unary(self, method, request):
        try:
            return await method(request, timeout=UNARY_TIMEOUT_S, metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            raise error_from_status(error) from None


def _check_file_name(name: str) -> None:
    if not name or "/" in name or "\\" in name or ".." in name:
        raise BackendError(f"Refusing tokenizer file name {name!r}: it could point outside the directory.")
