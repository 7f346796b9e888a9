"""The HTTP edge's ASGI middleware: metrics, request IDs, the API key, the body's bounds, admission.

A request passes them in this order (``frontend.app.create_app`` stacks them)::

    MetricsMiddleware         counts every answer by route and status; echoes X-Request-Id, or makes one
    AuthenticationMiddleware  the API key, from the headers alone: 401 before any body is read;
                              what goes on without a verified key is capped (--max-unauthenticated-requests)
    BodyReaderMiddleware      the whole body, within --http-body-timeout-s (408) and
                              --max-request-body-bytes (413), at most --max-concurrent-body-reads at once
    AdmissionMiddleware       the generation cap (--max-concurrent-requests, 429): counted only now,
                              once the key is checked and the body is read
    the routes

so a client without the key, or one that trickles its body, never holds a slot that an
authenticated request needs. The wait for a request's head (before any of this runs) is bounded by
``frontend.http_protocol``. Every refusal is an OpenAI error body, counted in
``tandem:http_requests_rejected{limit}`` under the flag that caused it.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from http import HTTPStatus
from typing import Awaitable, Optional, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.types.errors import OverloadedError, TandemError
from frontend.serving.anthropic_errors import ANTHROPIC_PATH_PREFIX, anthropic_error, anthropic_error_response
from frontend.serving.errors import (HTTP_STATUS_CLIENT_CLOSED_REQUEST, AuthenticationError, RequestTooLargeError,
                                     error_body, error_json_response, error_of_exception)

REQUEST_ID_HEADER = b"x-request-id"
_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+
T = TypeVar("T")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class HttpMetrics:
    """The frontend's HTTP metrics, in a registry of their own (one app, one registry)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tandem:http_requests", "HTTP requests answered, by route and status.",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("tandem:http_request_duration_seconds",
                                 "Seconds from request to the end of the response (whole stream).",
                                 ["route", "method"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("tandem:http_requests_in_progress", "HTTP requests being answered.",
                               registry=self.registry)
        self.rejected = Counter("tandem:http_requests_rejected", "HTTP requests refused at the edge, by the "
                                "limit they hit (before any work was queued).", ["limit"], registry=self.registry)


class MetricsMiddleware:
    """Counts every HTTP request by route (unknown paths as "other", to bound the labels) and
    status, and echoes the client's X-Request-Id (or sends a new one) on every response.

    One layer and one ``send`` wrapper for both, as a streamed response's every event passes it.
    """

    def __init__(self, app: ASGIApp, metrics: HttpMetrics, routes: frozenset[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes
        # The labelled children, by their labels: the same objects ``labels()`` returns, looked up
        # once per label set (the set is the metrics' own: routes, methods, statuses).
        self._counted: dict[tuple[str, str, int], Counter] = {}
        self._timed: dict[tuple[str, str], Histogram] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        status = HTTP_STATUS_CLIENT_CLOSED_REQUEST  # unless a response starts
        request_id = _header(scope, REQUEST_ID_HEADER) or uuid.uuid4().hex.encode()

        async def send_recorded(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (REQUEST_ID_HEADER, request_id)]}
            await send(message)

        self.metrics.in_flight.inc()
        start = time.perf_counter()
        try:
            await self.app(scope, receive, send_recorded)
        except Exception:
            status = 500
            raise
        finally:
            self.metrics.in_flight.dec()
            self._record(route, scope["method"], status, time.perf_counter() - start)

    def _record(self, route: str, method: str, status: int, seconds: float) -> None:
        counted = self._counted.get((route, method, status))
        if counted is None:
            counted = self._counted[route, method, status] = self.metrics.requests.labels(route, method, str(status))
        counted.inc()
        timed = self._timed.get((route, method))
        if timed is None:
            timed = self._timed[route, method] = self.metrics.latency.labels(route, method)
        timed.observe(seconds)


async def send_error(scope: Scope, receive: Receive, send: Send, error: TandemError, retry_after_s: int = 0,
                     close: bool = False) -> None:
    """``error`` as its OpenAI error response; ``close``: and end the connection after it (the
    request's body was not read, so the connection cannot carry another request)."""
    status, body = error_of_exception(error)
    await _send_error_body(scope, receive, send, status, body, retry_after_s, close)


async def _send_error_body(scope: Scope, receive: Receive, send: Send, status: int, body, retry_after_s: int,
                           close: bool) -> None:
    if scope["path"].startswith(ANTHROPIC_PATH_PREFIX):  # Anthropic's routes answer in Anthropic's shape
        response = anthropic_error_response(status, anthropic_error(status, body.error.message, body.error.param),
                                            retry_after_s)
    else:
        response = error_json_response(status, body, retry_after_s)
    if close:
        response.headers["connection"] = "close"
    await response(scope, receive, send)


def _header(scope: Scope, name: bytes) -> Optional[bytes]:
    return next((value for key, value in scope["headers"] if key == name), None)


class AuthenticationMiddleware:
    """The API key, checked from the headers before any body is read; a bound on the rest.

    A request to a path outside ``open_paths`` needs ``Authorization: Bearer <api_key>`` (OpenAI's
    clients) or ``x-api-key: <api_key>`` (Anthropic's) when a key is set: without it, a 401 at once (its body never read, the connection closed after it).
    Requests that go on without a verified key (``open_paths``: health, metrics, ...; and the
    401s themselves) take one of ``max_unauthenticated`` slots of their own, never one an
    authenticated request needs; beyond, a 429 at once.
    """

    def __init__(self, app: ASGIApp, api_key: Optional[str], open_paths: frozenset[str], max_unauthenticated: int,
                 retry_after_s: int, metrics: HttpMetrics) -> None:
        self.app, self.open_paths, self.metrics = app, open_paths, metrics
        self.expected = api_key.encode() if api_key else None
        self.max_unauthenticated, self.retry_after_s = max_unauthenticated, retry_after_s
        self.unauthenticated = 0  # requests being answered without a verified key

    def _authenticated(self, scope: Scope) -> bool:
        if self.expected is None:
            return True
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        # compare_digest: the time taken must not tell how much of the key matched.
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            return True
        x_api_key = _header(scope, b"x-api-key")
        return x_api_key is not None and hmac.compare_digest(x_api_key.strip(), self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_open = scope["path"] in self.open_paths
        if not is_open and self._authenticated(scope):
            await self.app(scope, receive, send)
            return
        if self.unauthenticated >= self.max_unauthenticated:
            self.metrics.rejected.labels("max_unauthenticated_requests").inc()
            await send_error(scope, receive, send, OverloadedError(
                f"The server is answering {self.max_unauthenticated} requests without a verified API key, its "
                "limit (--max-unauthenticated-requests); retry later."), self.retry_after_s, close=True)
            return
        self.unauthenticated += 1
        try:
            if is_open:
                await self.app(scope, receive, send)
            else:
                await send_error(scope, receive, send, AuthenticationError(
                    "Missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')."),
                    close=True)
        finally:
            self.unauthenticated -= 1


class BodyReaderMiddleware:
    """Reads a request's whole body before the app sees it, within bounds.

    At most ``max_bytes`` (else 413, unparsed), arriving whole within ``timeout_s`` of the request's
    head (else 408: a client trickling its body holds nothing for long), and at most
    ``max_concurrent`` bodies being read at once: a request beyond waits for a slot, within the
    same ``timeout_s`` (else 429), so a burst of quick requests queues for a moment rather than
    being refused, while slow bodies can hold only ``max_concurrent`` slots. ``skip_paths`` (the
    open routes, which take no body) are passed on unread. The refusals close the connection: its
    unread body cannot be told apart from a next request.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, max_concurrent: int, retry_after_s: int,
                 skip_paths: frozenset[str], metrics: HttpMetrics) -> None:
        self.app, self.max_bytes, self.timeout_s, self.metrics = app, max_bytes, timeout_s, metrics
        self.max_concurrent, self.retry_after_s, self.skip_paths = max_concurrent, retry_after_s, skip_paths
        self.reading = 0  # bodies being read now
        self._slots: Optional[asyncio.Semaphore] = None  # made on the server's loop, at its first request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.skip_paths:
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send, int(declared))
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrent)
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            if self._slots.locked():
                await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
            else:  # a slot is free: taken at once, with no task of wait_for's
                await self._slots.acquire()
        except asyncio.TimeoutError:
            self.metrics.rejected.labels("max_concurrent_body_reads").inc()
            await send_error(scope, receive, send, OverloadedError(
                f"The server was reading {self.max_concurrent} request bodies, its limit "
                f"(--max-concurrent-body-reads), for {self.timeout_s:g} s; retry later."), self.retry_after_s,
                close=True)
            return
        self.reading += 1
        try:
            # Cancelling a pending receive() loses nothing: the server keeps what arrived.
            remaining = max(deadline - asyncio.get_running_loop().time(), 0.0)
            first = await _within(remaining, self._read(receive))
        except asyncio.TimeoutError:
            self.metrics.rejected.labels("http_body_timeout_s").inc()
            await _send_error_body(scope, receive, send, HTTPStatus.REQUEST_TIMEOUT, error_body(
                HTTPStatus.REQUEST_TIMEOUT, f"The request body did not arrive whole within {self.timeout_s:g} s "
                "(the server's --http-body-timeout-s)."), 0, close=True)
            return
        except _BodyTooLarge as too_large:
            await self._too_large(scope, receive, send, too_large.size)
            return
        finally:
            self.reading -= 1
            self._slots.release()
        replayed = False

        async def replay() -> Message:  # the whole body once, then the client's messages (disconnect)
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> Message:
        """The body as one message, or the first message that is not body (the client left)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body arrived: let the app see it
                return message
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                raise _BodyTooLarge(size)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        self.metrics.rejected.labels("max_request_body_bytes").inc()
        await send_error(scope, receive, send, RequestTooLargeError(
            f"The request body ({size} bytes or more) is larger than the server's limit of {self.max_bytes} "
            "bytes (--max-request-body-bytes)."), close=True)


async def _within(seconds: float, awaitable: Awaitable[T]) -> T:
    """``await awaitable``, or ``asyncio.TimeoutError`` after ``seconds``: in this task where
    ``asyncio.timeout`` exists (Python 3.11+), not in a task of its own as ``wait_for`` runs it."""
    if _timeout is None:
        return await asyncio.wait_for(awaitable, seconds)
    async with _timeout(seconds):
        return await awaitable


class _BodyTooLarge(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


class AdmissionMiddleware:
    """Refuses a request to ``paths`` at once (429, ``Retry-After``) while ``limit`` are in flight.

    Counted only here, after the API key and the body (the middleware above), so neither a
    client without the key nor a slow one can hold a slot; in flight means until the response
    has ended, a stream included.
    """

    def __init__(self, app: ASGIApp, paths: frozenset[str], limit: int, retry_after_s: int,
                 metrics: HttpMetrics) -> None:
        self.app, self.paths, self.limit, self.retry_after_s, self.metrics = app, paths, limit, retry_after_s, metrics
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            self.metrics.rejected.labels("max_concurrent_requests").inc()
            await send_error(scope, receive, send, OverloadedError(
                f"The server is answering {self.limit} generation requests, its limit "
                "(--max-concurrent-requests); retry later."), self.retry_after_s)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
