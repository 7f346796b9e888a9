"""A bound on the wait for a request's head, below ASGI (uvicorn's HTTP protocol, subclassed).

No ASGI middleware runs before a request's line and headers have arrived, and uvicorn bounds
that wait only by size (h11's 16 KiB) and, after a response, by ``timeout_keep_alive`` until the
first byte of the next request. A client sending its head a byte at a time would hold its
connection for ever. ``head_deadline_protocol`` gives uvicorn a protocol class that:

- closes a connection whose head has not arrived whole ``timeout_s`` after it opened or after
  its last response ended (a 408 first when part of a head had arrived; an idle one just closes);
- keeps at most ``max_waiting`` connections in the middle of sending a head (some bytes of it
  arrived, not all): beyond, the one pending longest is closed, once it has been pending for
  ``EVICT_AFTER_S``. Before its head no connection is authenticated, so this is the trickling
  clients' own bound; an ordinary client's head arrives in one read, so it is never pending and
  never closed, not even in a burst of thousands of connections on a busy loop, and a new
  connection is never refused. A connection that sends nothing is closed by the head timeout.

Everything after the head (the key, the body, admission) is ``frontend.middleware``'s.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from http import HTTPStatus
from typing import Callable, Optional

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from frontend.serving.errors import error_body

# A connection part-way through its head this long is slow, not merely one of a burst: over the
# bound, the longest pending is closed only once it has been pending this long.
EVICT_AFTER_S = 1.0


def _timeout_response(message: str) -> bytes:
    body = error_body(HTTPStatus.REQUEST_TIMEOUT, message).model_dump_json().encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


def head_deadline_protocol(timeout_s: float, max_waiting: int,
                           on_close: Callable[[str], None] = lambda limit: None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``uvicorn.Config(http=...)``) with the bounds above.

    ``on_close(limit)`` is called for each connection closed, with the flag's setting name
    (``http_header_timeout_s`` or ``max_pending_connections``). One class per server: the
    connections waiting are counted across it.
    """
    waiting: OrderedDict[asyncio.Protocol, float] = OrderedDict()  # -> when it began waiting; oldest first
    messages = {  # why a connection that had begun a request was closed
        "http_header_timeout_s": _timeout_response(
            f"The request's head (line and headers) did not arrive within {timeout_s:g} s (the server's "
            "--http-header-timeout-s)."),
        "max_pending_connections": _timeout_response(
            f"More than {max_waiting} connections were waiting to send a request's head and this one had "
            "waited longest (the server's --max-pending-connections)."),
    }

    class HeadDeadlineProtocol(AutoHTTPProtocol):
        _head_timer: Optional[asyncio.TimerHandle] = None
        _head_started = False  # some bytes of the awaited head have arrived

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_head()

        def data_received(self, data: bytes) -> None:
            awaiting = self._head_timer is not None
            super().data_received(data)
            if not awaiting:
                return
            if not self._awaiting_head():  # the head arrived: the request is the middleware's now
                self._stop_awaiting()
            elif not self._head_started:  # part of a head: from now on it counts as pending
                self._head_started = True
                self._count_pending()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._awaiting_head():
                self._await_head()

        def connection_lost(self, exc) -> None:
            self._stop_awaiting()
            super().connection_lost(exc)

        def _awaiting_head(self) -> bool:
            # uvicorn makes a new cycle when a head arrives (a pipelined one too).
            return self.cycle is None or self.cycle.response_complete

        def _await_head(self) -> None:
            self._stop_awaiting()
            self._head_started = False
            self._head_timer = self.loop.call_later(timeout_s, self._close_waiting, "http_header_timeout_s")

        def _count_pending(self) -> None:
            """This connection has sent part of a head: it waits among the pending ones; beyond
            ``max_waiting`` the one pending longest is closed once it has been so for EVICT_AFTER_S.
            A whole head in one read (every ordinary client, in any burst) is never pending, and a
            connection that has sent nothing yet (or whose bytes a busy loop has not read yet)
            is bounded by the head timeout alone."""
            waiting[self] = self.loop.time()
            if len(waiting) > max_waiting:
                oldest, since = next(iter(waiting.items()))
                if self.loop.time() - since >= EVICT_AFTER_S:
                    oldest._close_waiting("max_pending_connections")

        def _stop_awaiting(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            waiting.pop(self, None)

        def _close_waiting(self, limit: str) -> None:
            started = self._head_started
            self._stop_awaiting()
            if self.transport.is_closing():
                return
            if started:  # a client in the middle of a request is told why
                self.transport.write(messages[limit])
            self.transport.close()
            on_close(limit)

    return HeadDeadlineProtocol
