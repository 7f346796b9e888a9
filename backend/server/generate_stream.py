"""GenerateStream: many requests multiplexed on one call, their deltas batched per message.

Each request on the call runs in a task of its own through ``EngineServicer.request_responses``
(the code a Generate call runs), so admission, validation, aborts and metrics are the same. The
tasks drop their responses into an outbox; one writer sends the outbox as one
``GenerateStreamResponse`` each time it wakes. The engine hands a step's outputs to every
request's queue at once, so the request tasks all run before the writer does: a message carries
the whole step. While a write waits on flow control, later steps pile up into the next message.

A request ends with one ``RequestStatus`` entry: OK, or the status its Generate call would have
failed with (``status_codes.status_of``, the one mapping). Its deadline (``timeout_ms``) is a
timer that cancels its task, as gRPC cancels a Generate call. Cancelling the call cancels every
task, which aborts their requests in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Iterable, Optional, Protocol

import grpc

from backend.server.metrics import EngineMetrics
from backend.server.status_codes import UndecodableRequest, status_of
from backend.types.errors import InvalidRequestError
from backend.types.limits import Limits
from protos.tandem.engine.v1 import engine_pb2

METHOD = "GenerateStream"
_OK = engine_pb2.RequestStatus(code=grpc.StatusCode.OK.value[0])
# Room left in each message for what ByteSize() does not count per entry (the entry's tag and length).
ENTRY_FRAMING_BYTES = 16


def request_status(code: grpc.StatusCode, message: str = "", param: Optional[str] = None) -> engine_pb2.RequestStatus:
    return engine_pb2.RequestStatus(code=code.value[0], message=message, error_param=param or "")


class RequestRunner(Protocol):
    """What a call needs of the servicer (``EngineServicer``): a request run as Generate runs it."""

    limits: Limits
    metrics: Optional[EngineMetrics]

    def request_responses(self, request: engine_pb2.GenerateRequest, deadline: Optional[float],
                          caller: object) -> AsyncIterator[engine_pb2.GenerateResponse]: ...

    async def abort_requests(self, request_ids: Iterable[str], caller: object) -> None: ...


class GenerateStreamCall:
    """One GenerateStream call: its requests' tasks and the outbox its writer drains."""

    def __init__(self, servicer: RequestRunner, context: grpc.aio.ServicerContext, caller: object) -> None:
        self.servicer = servicer
        self.context = context
        self.caller = caller  # who may abort its requests (``servicer.caller_of``)
        self.message_limit = servicer.limits.max_grpc_message_bytes
        self.tasks: set[asyncio.Task] = set()
        self._outbox: dict[str, list[engine_pb2.GenerateResponse]] = {}  # by request ID, in order of news
        self._statuses: dict[str, engine_pb2.RequestStatus] = {}  # ends not yet sent
        self._dropped: set[str] = set()  # requests ended by the writer (an entry past the message limit)
        self._ready = asyncio.Event()
        self._reader: Optional[asyncio.Task] = None

    async def serve(self, requests: AsyncIterator[engine_pb2.GenerateStreamRequest]) -> None:
        """Read requests and aborts until the client half-closes, and write until every request
        has ended. An undecodable message ends the call INVALID_ARGUMENT (raised here)."""
        self._reader = asyncio.ensure_future(self._read(requests))
        self._reader.add_done_callback(lambda _: self._ready.set())
        try:
            await self._write_until_done()
        finally:
            self._reader.cancel()
            for task in self.tasks:
                task.cancel()  # each aborts its request in the engine
            await asyncio.gather(self._reader, *self.tasks, return_exceptions=True)

    # ---- reading ---------------------------------------------------------------------------------

    async def _read(self, requests: AsyncIterator[engine_pb2.GenerateStreamRequest]) -> None:
        async for message in requests:
            if isinstance(message, UndecodableRequest):
                raise InvalidRequestError(f"A GenerateStream message does not decode: {message.error}")
            for item in message.requests:
                task = asyncio.ensure_future(self._run(item))
                self.tasks.add(task)
                task.add_done_callback(self._task_done)
            if message.abort_request_ids:
                await self.servicer.abort_requests(message.abort_request_ids, self.caller)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self._ready.set()

    async def _run(self, item: engine_pb2.StreamedGenerateRequest) -> None:
        """One request, start to end; its responses and its status go to the outbox."""
        request_id = item.request.request_id
        deadline, timer, expired = None, None, False
        if item.HasField("timeout_ms"):
            timeout_s = item.timeout_ms / 1000
            deadline = time.monotonic() + timeout_s
            task = asyncio.current_task()

            def expire() -> None:
                nonlocal expired
                expired = True
                task.cancel()

            timer = asyncio.get_running_loop().call_later(timeout_s, expire)
        status = _OK
        try:
            responses = self.servicer.request_responses(item.request, deadline, self.caller)
            async with contextlib.aclosing(responses):
                async for response in responses:
                    self._add(request_id, response)
        except asyncio.CancelledError:
            if not expired:
                raise  # the call is ending: nothing more is sent
            status = request_status(grpc.StatusCode.DEADLINE_EXCEEDED, "The request's deadline (timeout_ms) "
                                    "passed; the request was aborted.")
        except Exception as error:  # noqa: BLE001 -- every error ends the request with a status
            code, message, param = status_of(error, METHOD)
            if self.servicer.metrics is not None:
                self.servicer.metrics.observe_rejected(METHOD, code.name.lower())
            status = request_status(code, message, param)
        finally:
            if timer is not None:
                timer.cancel()
        self._end(request_id, status)

    # ---- the outbox ------------------------------------------------------------------------------

    def _add(self, request_id: str, response: engine_pb2.GenerateResponse) -> None:
        if request_id in self._dropped:
            return
        pending = self._outbox.get(request_id)
        if pending is None:
            self._outbox[request_id] = [response]
            self._ready.set()
        else:
            pending.append(response)

    def _end(self, request_id: str, status: engine_pb2.RequestStatus) -> None:
        if request_id in self._dropped:
            self._dropped.discard(request_id)  # its status is sent already; the ID may be reused
            return
        self._statuses[request_id] = status
        self._outbox.setdefault(request_id, [])
        self._ready.set()

    def _take(self) -> list[engine_pb2.RequestDeltas]:
        """The outbox as entries, emptied."""
        outbox, self._outbox = self._outbox, {}
        statuses = self._statuses
        entries = []
        for request_id, responses in outbox.items():
            entry = engine_pb2.RequestDeltas(request_id=request_id, responses=responses)
            status = statuses.pop(request_id, None)
            if status is not None:
                entry.status.CopyFrom(status)
            entries.append(entry)
        return entries

    # ---- writing ---------------------------------------------------------------------------------

    async def _write_until_done(self) -> None:
        reader = self._reader
        while True:
            # Clear, then look at everything, then wait: a change after the clear wakes the wait,
            # one before it is seen by the looks (news, a request's end, the reader's end).
            self._ready.clear()
            if self._outbox:
                for message in await self._messages(self._take()):
                    await self.context.write(message)
                continue
            if reader.done():
                if not reader.cancelled() and reader.exception() is not None:
                    raise reader.exception()  # an undecodable message: the call ends with its status
                if not self.tasks:
                    return  # half-closed and every request ended: the call ends OK
            await self._ready.wait()

    async def _messages(self, entries: list[engine_pb2.RequestDeltas]) -> list[engine_pb2.GenerateStreamResponse]:
        """``entries`` in as few messages as fit under the message limit, in order. An entry too big
        for one message goes in pieces over consecutive messages (its responses in order, its
        status with the last); one response too big for any message ends its request
        RESOURCE_EXHAUSTED instead (the rest of the call goes on)."""
        message = engine_pb2.GenerateStreamResponse(requests=entries)
        if message.ByteSize() <= self.message_limit:
            return [message]
        messages, batch, size = [], [], 0
        for entry in entries:
            for piece in self._pieces(entry):
                piece_size = piece.ByteSize() + ENTRY_FRAMING_BYTES
                too_big = piece_size > self.message_limit  # a single response larger than any message
                if too_big:
                    piece = await self._too_big(entry)
                    piece_size = piece.ByteSize() + ENTRY_FRAMING_BYTES
                # A request appears at most once in a message: its next piece starts the next one.
                if batch and (size + piece_size > self.message_limit or batch[-1].request_id == piece.request_id):
                    messages.append(engine_pb2.GenerateStreamResponse(requests=batch))
                    batch, size = [], 0
                batch.append(piece)
                size += piece_size
                if too_big:
                    break  # its status is sent: nothing more of it
        if batch:
            messages.append(engine_pb2.GenerateStreamResponse(requests=batch))
        return messages

    def _pieces(self, entry: engine_pb2.RequestDeltas) -> list[engine_pb2.RequestDeltas]:
        """``entry`` as one piece, or as several that each fit a message where its responses do."""
        if entry.ByteSize() + ENTRY_FRAMING_BYTES <= self.message_limit:
            return [entry]
        frame = engine_pb2.RequestDeltas(request_id=entry.request_id)
        if entry.HasField("status"):
            frame.status.CopyFrom(entry.status)
        room = self.message_limit - ENTRY_FRAMING_BYTES - frame.ByteSize()
        pieces, current, size = [], [], 0
        for response in entry.responses:
            response_size = response.ByteSize() + ENTRY_FRAMING_BYTES
            if current and size + response_size > room:
                pieces.append(engine_pb2.RequestDeltas(request_id=entry.request_id, responses=current))
                current, size = [], 0
            current.append(response)
            size += response_size
        last = engine_pb2.RequestDeltas(request_id=entry.request_id, responses=current)
        if entry.HasField("status"):
            last.status.CopyFrom(entry.status)
        return pieces + [last]

    async def _too_big(self, entry: engine_pb2.RequestDeltas) -> engine_pb2.RequestDeltas:
        request_id = entry.request_id
        if not entry.HasField("status"):  # still running: stop it, and drop what it still sends
            self._dropped.add(request_id)
            await self.servicer.abort_requests([request_id], self.caller)
        if self.servicer.metrics is not None:
            self.servicer.metrics.observe_rejected(METHOD, "resource_exhausted")
        return engine_pb2.RequestDeltas(request_id=request_id, status=request_status(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"A response of the request is larger than the largest gRPC message ({self.message_limit} bytes); "
            "the request was aborted."))
