"""The edge before admission: the API key is checked from the head, slow heads and bodies time out
(408), and unauthenticated clients have bounds of their own, so they never take an authenticated
request's slot. (Admission itself and deadlines: tests/test_admission.py.) The tests speak raw
HTTP/1.1 over loopback sockets, to send heads and bodies as slowly as they like.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import httpx
import pytest
from conftest import TINY_VOCAB, build_tokenizer
from helpers import LoopThread, uvicorn_on

from backend.types.limits import Limits
from backend.types.outputs import EngineOutput, FinishReason, ModelInfo
from frontend.app import create_app
from frontend.http_protocol import EVICT_AFTER_S
from frontend.tokenizer import load_tokenizer

COMPLETION = {"prompt": "Hello", "max_tokens": 4}


async def _make_event() -> asyncio.Event:
    """An Event made on the loop that will wait on it."""
    return asyncio.Event()


API_KEY = "k3y"
AUTHORIZED = {"Authorization": f"Bearer {API_KEY}"}


class QuickEngine:
    """An EngineClient that answers every request with one token at once; ``healthy`` gates /health."""

    def __init__(self) -> None:
        self.healthy: Optional[asyncio.Event] = None  # when set, /health waits for it

    async def generate(self, request_id, prompt_token_ids, params, **options):
        yield EngineOutput(request_id, 0, [5], finish_reason=FinishReason.LENGTH,
                           num_prompt_tokens=len(prompt_token_ids))

    async def abort(self, request_id):
        pass

    async def health(self) -> bool:
        if self.healthy is not None:
            await self.healthy.wait()
        return True


@contextmanager
def edge_server(tmp_path, api_key: Optional[str] = API_KEY,
                **limits) -> Iterator[tuple[str, int, QuickEngine, LoopThread]]:
    """The app over a QuickEngine, served by uvicorn with the app's own HTTP protocol (the head bounds)."""
    build_tokenizer(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    engine = QuickEngine()
    app = create_app(engine, tokenizer, ModelInfo("m", 128, TINY_VOCAB, [tokenizer.eos_token_id]), api_key=api_key,
                     limits=Limits(**limits))
    loop = LoopThread()
    try:
        with uvicorn_on(loop, app, http=app.state.http_protocol) as base_url:
            yield base_url, int(base_url.rsplit(":", 1)[1]), engine, loop
    finally:
        loop.close()


def raw_connection(port: int, data: bytes = b"") -> socket.socket:
    """A loopback connection that has sent ``data`` (and nothing more, until told)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    if data:
        sock.sendall(data)
    return sock


def slow_body_head(path: str = "/v1/completions", headers: dict = {}, length: int = 1000) -> bytes:
    """A request head announcing ``length`` body bytes, and the first few of them."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Content-Length: {length}", *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n" + '{"prompt": "Hel').encode()


def read_response(sock: socket.socket) -> tuple[Optional[int], dict, bytes]:
    """(status, headers, body) of the next response; (None, {}, b"") when the server closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, {}, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in header_lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closed the connection (EOF) rather than keeping it open."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


async def authenticated_completions(base_url: str, count: int) -> list[int]:
    async with httpx.AsyncClient(base_url=base_url, timeout=30, headers=AUTHORIZED) as http:
        responses = await asyncio.gather(*(http.post("/v1/completions", json=COMPLETION) for _ in range(count)))
    return [r.status_code for r in responses]


@pytest.mark.timeout(60)
def test_unauthenticated_slow_bodies_do_not_take_the_cap_from_authenticated_requests(tmp_path):
    """Acceptance: 8 unauthenticated slow-body connections against a cap of 4; authenticated requests
    still succeed. Each slow client gets its 401 from its head alone, its body never waited for."""
    with edge_server(tmp_path, max_concurrent_requests=4, http_body_timeout_s=30) as (base_url, port, _, _):
        slow = [raw_connection(port, slow_body_head(headers=headers))
                for headers in [{}] * 4 + [{"Authorization": "Bearer wrong"}] * 4]
        try:
            # All 8 are still connected (none has sent its body) while 4 + 4 authenticated ones are answered.
            assert asyncio.run(asyncio.wait_for(authenticated_completions(base_url, 4), 30)) == [200] * 4
            assert asyncio.run(asyncio.wait_for(authenticated_completions(base_url, 4), 30)) == [200] * 4
            for sock in slow:
                status, headers, body = read_response(sock)
                assert status == 401 and headers["connection"] == "close", body
                assert json.loads(body)["error"]["type"] == "AuthenticationError"
                assert closed_by_server(sock)
        finally:
            for sock in slow:
                sock.close()


@pytest.mark.timeout(60)
def test_authenticated_slow_bodies_time_out_with_408_and_hold_no_admission_slot(tmp_path):
    with edge_server(tmp_path, max_concurrent_requests=4, http_body_timeout_s=2) as (base_url, port, _, _):
        slow = [raw_connection(port, slow_body_head(headers=AUTHORIZED)) for _ in range(8)]
        try:
            started = time.monotonic()
            # Admission counts a request once its body is read: the 8 bodies still arriving hold no slot.
            assert asyncio.run(asyncio.wait_for(authenticated_completions(base_url, 4), 30)) == [200] * 4
            for sock in slow:
                status, headers, body = read_response(sock)
                assert status == 408 and headers["connection"] == "close", body
                assert "--http-body-timeout-s" in json.loads(body)["error"]["message"]
                assert closed_by_server(sock)
            assert 1.5 < time.monotonic() - started < 20
            metrics = httpx.get(base_url + "/metrics", timeout=10).text
            assert 'tandem:http_requests_rejected_total{limit="http_body_timeout_s"} 8.0' in metrics
        finally:
            for sock in slow:
                sock.close()


@pytest.mark.timeout(60)
def test_slow_and_idle_heads_are_closed_after_the_header_timeout(tmp_path):
    with edge_server(tmp_path, http_header_timeout_s=1) as (base_url, port, _, _):
        partial = raw_connection(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        idle = raw_connection(port)
        try:
            started = time.monotonic()
            status, headers, body = read_response(partial)
            assert status == 408 and "--http-header-timeout-s" in json.loads(body)["error"]["message"]
            assert closed_by_server(partial)
            assert closed_by_server(idle)  # nothing sent: closed without a word
            assert 0.5 < time.monotonic() - started < 15
            # A keep-alive connection gets the same bound on its next head, after a full answer.
            kept = raw_connection(port, b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(kept)[0] == 200
            kept.sendall(b"GET /version HTTP/1.1\r\n")
            assert read_response(kept)[0] == 408
            kept.close()
            assert httpx.get(base_url + "/version", timeout=10).status_code == 200
            metrics = httpx.get(base_url + "/metrics", timeout=10).text
            assert 'tandem:http_requests_rejected_total{limit="http_header_timeout_s"} 3.0' in metrics
        finally:
            partial.close()
            idle.close()


@pytest.mark.timeout(60)
def test_connections_waiting_for_a_head_are_capped_oldest_first(tmp_path):
    with edge_server(tmp_path, max_pending_connections=4, http_header_timeout_s=60) as (base_url, port, _, _):
        waiting = [raw_connection(port, b"GET /vers") for _ in range(4)]
        time.sleep(EVICT_AFTER_S + 0.2)  # the four are waiting, in order, long enough to count as slow
        newer = [raw_connection(port, b"GET /vers") for _ in range(2)]
        try:
            # The two that waited longest make room; the newest still wait.
            for sock in waiting[:2]:
                assert read_response(sock)[0] == 408
            for sock in waiting[2:] + newer:
                sock.settimeout(0.5)
                with pytest.raises(socket.timeout):
                    sock.recv(1)
            # A client that sends its head at once is answered (it evicts a waiting one, never itself).
            assert asyncio.run(asyncio.wait_for(authenticated_completions(base_url, 1), 30)) == [200]
        finally:
            for sock in waiting + newer:
                sock.close()


@pytest.mark.timeout(60)
def test_unauthenticated_requests_have_their_own_cap(tmp_path):
    with edge_server(tmp_path, max_unauthenticated_requests=2, max_concurrent_requests=2) as (base_url, _, engine,
                                                                                              loop):
        engine.healthy = loop.run(_make_event())

        async def scenario() -> tuple:
            async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
                held = [asyncio.ensure_future(http.get("/health")) for _ in range(2)]
                await asyncio.sleep(0.5)  # both wait on the engine's health
                refused = await http.get("/health")
                no_key = await http.post("/v1/completions", json=COMPLETION)
                authenticated = await authenticated_completions(base_url, 2)
                loop.loop.call_soon_threadsafe(engine.healthy.set)
                return [r.status_code for r in await asyncio.gather(*held)], refused, no_key, authenticated

        held, refused, no_key, authenticated = asyncio.run(asyncio.wait_for(scenario(), 30))
        assert held == [200, 200] and authenticated == [200, 200]
        assert refused.status_code == 429 and "--max-unauthenticated-requests" in refused.json()["error"]["message"]
        assert no_key.status_code == 429  # a 401 to send takes a slot of the same cap
        assert httpx.post(base_url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 401


@pytest.mark.timeout(60)
def test_body_reads_beyond_the_cap_wait_for_a_slot(tmp_path):
    """Two slow bodies hold the two slots; a third request waits (rather than a 429) and is served
    once a slot frees; the rejection counter names no refusal."""
    with edge_server(tmp_path, api_key=None, max_concurrent_body_reads=2) as (base_url, port, _, _):
        slow = [raw_connection(port, slow_body_head()) for _ in range(2)]
        try:
            time.sleep(0.5)  # both bodies are being read
            body = b'{"prompt": "Hello", "max_tokens": 2}'
            third = raw_connection(port, slow_body_head(length=len(body))[:-len('{"prompt": "Hel')] + body)
            third.settimeout(0.5)
            with pytest.raises(socket.timeout):  # waiting for a slot: no answer yet
                third.recv(1)
            third.settimeout(30)
            slow[0].sendall(b'lo", "max_tokens": 2}'.ljust(1000 - len('{"prompt": "Hel'), b" "))
            assert read_response(slow[0])[0] == 200
            assert read_response(third)[0] == 200  # the freed slot was its
            third.close()
            slow[1].sendall(b'lo", "max_tokens": 2}'.ljust(1000 - len('{"prompt": "Hel'), b" "))
            assert read_response(slow[1])[0] == 200
            metrics = httpx.get(base_url + "/metrics", timeout=10).text
            assert 'limit="max_concurrent_body_reads"' not in metrics
        finally:
            for sock in slow:
                sock.close()
