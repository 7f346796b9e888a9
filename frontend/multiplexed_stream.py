"""MultiplexedStream: many requests on one GenerateStream call to a backend (torch-free).

One bidirectional call carries every request a client sends to its backend: requests and
aborts go out batched in ``GenerateStreamRequest``s; each ``GenerateStreamResponse`` holds the
deltas of many requests (an engine step's), which one reader task hands to each request's inbox.
So the per-message cost of gRPC is paid once per step, not once per request per step.

A request behaves as on its own Generate call: closing its iterator early (a client gone, a
stop string) aborts it on the backend; its deadline travels as ``timeout_ms`` and is also kept
here, so a backend that stops answering still ends it (``RequestTimeoutError``); its end status
becomes the same typed error (``error_from_code``). If the call itself fails, every request on
it fails with the call's status (UNAVAILABLE when the backend dies: the router's health logic
sees what it saw from Generate). A backend without the RPC answers UNIMPLEMENTED: each request
then raises ``StreamUnsupported`` before any output, and the client sends it with Generate; a
call that ends INTERNAL raises ``StreamBroken`` in the requests that had no output yet, which the
client also sends again with Generate (see ``StreamBroken``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import time
from typing import AsyncIterator, Callable, Optional

import grpc

from backend.types.errors import InvalidRequestError, RequestTimeoutError, TandemError
from backend.types.outputs import EngineOutput
from frontend.proto_convert import OutputReader
from protos.tandem.engine.v1 import engine_pb2

GenerateResponse = engine_pb2.GenerateResponse
RequestStatus = engine_pb2.RequestStatus
_OK = grpc.StatusCode.OK.value[0]
# Bytes of a GenerateStreamRequest around its items (each item's tag and length): room kept under the limit.
ITEM_FRAMING_BYTES = 16
CLOSE_GRACE_S = 1.0  # how long closing an idle call waits for the backend to end it
MAX_ABORTS_PER_MESSAGE = 1024  # request IDs are at most 256 characters: ~0.26 MiB a message


class StreamUnsupported(Exception):
    """The backend has no GenerateStream (UNIMPLEMENTED); nothing of the request ran."""


class StreamBroken(Exception):
    """The call failed INTERNAL before the request had any output: with gRPC's Python client, a
    write racing the call's end replaces the status the backend sent (an UNAUTHENTICATED, an
    UNAVAILABLE) with INTERNAL "Internal error from Core". The call's end aborted the request on
    the backend; sent again with Generate, it gets the real status."""


class _TimedOut:
    """What a request's deadline timer puts in its inbox."""


_TIMED_OUT = _TimedOut()


class _Inbox:
    """One request's arrivals (responses, then its end), and the consumer waiting on them.

    It keeps the event loop it was made on: ``asyncio.get_running_loop()`` costs a ``getpid``
    system call (its fork check), and ``wait`` runs once per delta of every request."""

    __slots__ = ("items", "waiter", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: collections.deque = collections.deque()
        self.waiter: Optional[asyncio.Future] = None
        self._loop = loop

    def put(self, item: object) -> None:
        self.items.append(item)
        self._wake()

    def put_many(self, items) -> None:
        self.items.extend(items)
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        self.waiter = self._loop.create_future()
        await self.waiter


# (code number, message, param) -> the typed error; a call's own failure -> a fresh typed error.
ErrorFromCode = Callable[[grpc.StatusCode, str, Optional[str]], TandemError]


class MultiplexedStream:
    """One GenerateStream call on ``stub``, shared by the requests of ``generate`` (see the module doc).

    ``error_from_code`` and ``error_from_call`` are the client's one error mapping;
    ``reader_of(request_id).read(response)`` turns one request's responses into ``EngineOutput``s
    (None for a response that only carries a part of what a later one completes).
    """

    def __init__(self, stub, metadata: tuple, message_limit: int, error_from_code: ErrorFromCode,
                 error_from_call: Callable[[grpc.aio.AioRpcError], TandemError],
                 reader_of: Callable[[str], OutputReader]) -> None:
        self.opened_at = time.monotonic()
        self.message_limit = message_limit
        self._error_from_code = error_from_code
        self._error_from_call = error_from_call
        self._reader_of = reader_of
        self._requests: dict[str, _Inbox] = {}  # running requests by ID
        self._outgoing: collections.deque = collections.deque()  # (StreamedGenerateRequest, its size)
        self._aborts: list[str] = []
        self._send_ready = asyncio.Event()
        self._half_closed = False
        self._cancelled = False
        self._failure: Optional[Callable[[], BaseException]] = None  # set once the call has ended
        self._loop = asyncio.get_running_loop()
        self._call = stub.GenerateStream(metadata=metadata)  # written by _write, read by _read
        self._writer = asyncio.ensure_future(self._write())
        self._reader = asyncio.ensure_future(self._read())

    @property
    def open(self) -> bool:
        """New requests may start on it."""
        return self._failure is None and not self._half_closed

    @property
    def ended(self) -> bool:
        return self._failure is not None

    def fits(self, request: engine_pb2.GenerateRequest) -> bool:
        """Whether a request fits in one message of the call (else it must go by Generate)."""
        return request.ByteSize() + 2 * ITEM_FRAMING_BYTES <= self.message_limit

    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    async def generate(self, request: engine_pb2.GenerateRequest,
                       deadline: Optional[float] = None) -> AsyncIterator[EngineOutput]:
        """Stream one request's deltas; as ``GrpcEngineClient.generate``. Raises ``StreamUnsupported``
        (before any output) when the backend lacks the RPC."""
        if not self.open:
            raise RuntimeError("MultiplexedStream.generate on a stream that takes no new requests")
        request_id = request.request_id
        if request_id in self._requests:  # its entries could not be told apart from the running one's
            raise InvalidRequestError(f"Request ID {request_id!r} is already in use.", param="request_id")
        inbox = self._requests[request_id] = _Inbox(self._loop)
        item = engine_pb2.StreamedGenerateRequest(request=request)
        timer = None
        if deadline is not None:
            remaining = max(deadline - time.monotonic(), 0.0)
            item.timeout_ms = math.ceil(remaining * 1000)
            timer = self._loop.call_later(remaining, inbox.put, _TIMED_OUT)
        self._outgoing.append((item, item.ByteSize() + ITEM_FRAMING_BYTES))
        self._send_ready.set()
        ended = False  # the backend is done with it (its status came, or the call ended)
        started = False  # it has had output
        read = self._reader_of(request_id).read
        items = inbox.items
        try:
            while True:
                if not items:
                    await inbox.wait()
                arrival = items.popleft()
                if arrival.__class__ is GenerateResponse:
                    started = True
                    output = read(arrival)
                    if output is not None:
                        yield output
                elif arrival.__class__ is RequestStatus:
                    ended = True
                    if arrival.code != _OK:
                        raise self._error_from_code(grpc_status(arrival.code), arrival.message,
                                                    arrival.error_param or None)
                    return
                elif arrival is _TIMED_OUT:
                    raise RequestTimeoutError("The request did not finish before its deadline.")
                else:  # the call ended: a function making this request's error
                    ended = True
                    error = arrival()
                    if isinstance(error, StreamBroken) and started:
                        raise self._error_from_code(grpc.StatusCode.UNAVAILABLE,
                                                    f"the GenerateStream call broke ({error})", None)
                    raise error
        finally:
            if timer is not None:
                timer.cancel()
            # The reader drops a request once its status came: the backend has ended it, even if
            # its reader stopped at the last delta before reading that status (the usual end).
            if self._requests.get(request_id) is inbox:
                del self._requests[request_id]
                if not ended and self._failure is None:  # closed early or timed out: stop it on the backend
                    self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Ask the backend to abort a request of this call (its stream ends with ABORT outputs)."""
        self._aborts.append(request_id)
        self._send_ready.set()

    def half_close(self) -> None:
        """Take no new requests; the call ends once those running have ended."""
        self._half_closed = True
        self._send_ready.set()

    async def close(self, grace: float = CLOSE_GRACE_S) -> None:
        """End the call: at once if requests are running (the backend aborts them; they fail here),
        else by half-closing it and waiting up to ``grace`` seconds for the backend's end (which
        leaves gRPC nothing in flight when the event loop closes)."""
        if not self._requests and not self.ended:
            self.half_close()
            await asyncio.wait((self._reader,), timeout=grace)
        if not self._reader.done():
            self._cancelled = True
            self._call.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)

    # ---- the two directions ------------------------------------------------------------------------

    async def _write(self) -> None:
        """What goes out: every request and abort queued since the last message, batched; then,
        once half-closed, the end of the client's side."""
        try:
            while self._failure is None:
                await self._send_ready.wait()
                self._send_ready.clear()
                while self._outgoing or self._aborts:
                    await self._call.write(self._next_message())
                if self._half_closed:
                    await self._call.done_writing()
                    return
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return  # the call has ended: the reader tells the requests why

    def _next_message(self) -> engine_pb2.GenerateStreamRequest:
        message = engine_pb2.GenerateStreamRequest()
        size = 0
        while self._outgoing and (not message.requests or size + self._outgoing[0][1] <= self.message_limit // 2):
            item, item_size = self._outgoing.popleft()
            message.requests.append(item)
            size += item_size
        if self._aborts:
            message.abort_request_ids.extend(self._aborts[:MAX_ABORTS_PER_MESSAGE])
            del self._aborts[:MAX_ABORTS_PER_MESSAGE]
        return message

    async def _read(self) -> None:
        """Hand each arrival to its request's inbox; when the call ends, fail those still running."""
        requests = self._requests
        failure: Optional[Callable[[], BaseException]] = None
        try:
            async for message in self._call:
                for entry in message.requests:
                    inbox = requests.get(entry.request_id)
                    if inbox is None:
                        continue  # closed early here: its end is of no interest
                    if entry.responses:
                        inbox.put_many(entry.responses)
                    if entry.HasField("status"):
                        del requests[entry.request_id]
                        inbox.put(entry.status)
            await self._call.code()  # the call's status has arrived: gRPC holds nothing of it any more
            failure = lambda: self._error_from_code(  # noqa: E731 -- a protocol error of the backend's
                grpc.StatusCode.UNKNOWN, "the backend ended the GenerateStream call before the request ended", None)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                failure = StreamUnsupported
            elif error.code() == grpc.StatusCode.INTERNAL:
                failure = functools.partial(StreamBroken, error.details())
            else:
                failure = functools.partial(self._error_from_call, error)  # a fresh error per request
        except asyncio.CancelledError:
            if not self._cancelled:
                raise
        finally:
            self._failure = failure or (lambda: self._error_from_code(
                grpc.StatusCode.UNAVAILABLE, "the GenerateStream call to the backend was closed", None))
            for inbox in requests.values():
                inbox.put(self._failure)
            requests.clear()
            self._send_ready.set()  # ends the request iterator


_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


def grpc_status(number: int) -> grpc.StatusCode:
    """The status code of its number (UNKNOWN for a number gRPC does not define)."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)
