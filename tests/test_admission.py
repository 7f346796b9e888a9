"""Admission control and deadlines: a full server refuses the excess at once (HTTP 429 with
Retry-After, gRPC RESOURCE_EXHAUSTED) and serves the rest; a deadline reaches the engine. The edge
before admission: the API key is checked from the head, slow heads and bodies time out (408), and
unauthenticated clients have bounds of their own, so they never take an authenticated request's slot.

The frontend's cap is tested over a fake engine that holds every stream open until told; the
backend's over a tiny random Llama whose steps are slowed down, through the real frontend. The
edge's tests speak raw HTTP/1.1 over loopback sockets, to send heads and bodies as slowly as they like.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Iterator, Optional

import grpc
import httpx
import pytest
from conftest import TINY_VOCAB, build_tokenizer
from helpers import LoopThread, backend_and_frontend, uvicorn_on, wait_for
from prometheus_client import generate_latest

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.types.config import EngineConfig
from backend.types.limits import Limits
from backend.types.outputs import EngineOutput, FinishReason, ModelInfo
from frontend.app import create_app
from frontend.grpc_client import GrpcEngineClient
from frontend.http_protocol import EVICT_AFTER_S
from frontend.tokenizer import load_tokenizer
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

COMPLETION = {"prompt": "Hello", "max_tokens": 4}


class HeldEngine:
    """An EngineClient whose streams send one token, then wait until ``release`` is set."""

    def __init__(self, eos: int) -> None:
        self.eos = eos
        self.active = 0
        self.release = asyncio.Event()

    async def generate(self, request_id, prompt_token_ids, params, **options):
        self.active += 1
        try:
            yield EngineOutput(request_id, 0, [5], num_prompt_tokens=len(prompt_token_ids))
            await self.release.wait()
            yield EngineOutput(request_id, 0, [6], finish_reason=FinishReason.LENGTH,
                               num_prompt_tokens=len(prompt_token_ids))
        finally:
            self.active -= 1

    async def abort(self, request_id):
        pass

    async def health(self) -> bool:
        return True


async def send_all(base_url: str, count: int, body: dict, started=None) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        tasks = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(count)]
        if started is not None:
            await started()
        return await asyncio.gather(*tasks)


@pytest.mark.parametrize("stream", [False, True])
def test_frontend_cap_k_of_k_plus_m_held_requests_exactly_m_get_429(tmp_path, stream):
    k, m = 3, 4
    build_tokenizer(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    loop = LoopThread()
    engine = HeldEngine(tokenizer.eos_token_id)
    engine.release = loop.run(_make_event())
    app = create_app(engine, tokenizer, ModelInfo("m", 128, TINY_VOCAB, [engine.eos]),
                     limits=Limits(max_concurrent_requests=k, retry_after_s=7))
    try:
        with uvicorn_on(loop, app) as base_url:
            async def release_when_refused_and_held():
                # The m refusals come back while the k admitted requests are held open.
                await asyncio.wait_for(_until(lambda: engine.active == k), 20)
                loop.loop.call_soon_threadsafe(engine.release.set)

            responses = asyncio.run(asyncio.wait_for(send_all(
                base_url, k + m, {**COMPLETION, "stream": stream}, release_when_refused_and_held), 60))
            refused = [r for r in responses if r.status_code == 429]
            assert len(refused) == m, [r.status_code for r in responses]
            assert all(r.headers["retry-after"] == "7" for r in refused)
            assert all(r.json()["error"]["type"] == "RateLimitError" for r in refused)
            assert "--max-concurrent-requests" in refused[0].json()["error"]["message"]
            finished = [r for r in responses if r.status_code == 200]
            assert len(finished) == k
            assert all(("[DONE]" in r.text) if stream else r.json()["choices"][0]["finish_reason"] == "length"
                       for r in finished)
            # Capacity is back once they ended.
            assert wait_for(lambda: engine.active == 0)
            assert httpx.post(base_url + "/v1/completions", json=COMPLETION, timeout=30).status_code == 200
            metrics = httpx.get(base_url + "/metrics", timeout=10).text
            assert f'tandem:http_requests_rejected_total{{limit="max_concurrent_requests"}} {float(m)}' in metrics
    finally:
        loop.close()


async def _make_event() -> asyncio.Event:
    return asyncio.Event()


async def _until(condition, interval: float = 0.01) -> None:
    while not condition():
        await asyncio.sleep(interval)


# ---- the backend's queue bound, through the frontend ---------------------------------------------


MAX_NUM_SEQS, MAX_QUEUED = 2, 2


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    """A backend admitting MAX_NUM_SEQS + MAX_QUEUED sequences, steps slowed to 20 ms, and a frontend."""
    model_dir = tiny_checkpoint("llama")
    loop = LoopThread()
    limits = Limits(max_num_queued_requests=MAX_QUEUED, retry_after_s=3)
    engine = AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=4,
                                         max_model_len=64, max_num_seqs=MAX_NUM_SEQS), limits)
    step = engine.engine.step

    def slow_step():
        time.sleep(0.02)
        return step()

    engine.engine.step = slow_step
    try:
        with backend_and_frontend(loop, engine, limits) as (server, address, base_url):
            yield SimpleNamespace(base_url=base_url, address=address, engine=engine, server=server, loop=loop)
    finally:
        engine.shutdown()
        loop.close()


def test_backend_queue_full_is_resource_exhausted_and_429_with_retry_after(stack):
    base_url, address, engine = stack.base_url, stack.address, stack.engine
    k, m = MAX_NUM_SEQS + MAX_QUEUED, 3
    body = {"prompt": [1, 2, 3], "max_tokens": 30, "ignore_eos": True}
    responses = asyncio.run(asyncio.wait_for(send_all(base_url, k + m, body), 120))
    refused = [r for r in responses if r.status_code == 429]
    assert len(refused) == m, [r.status_code for r in responses]
    assert all(r.headers["retry-after"] == "3" for r in refused)
    assert "--max-num-queued-requests" in refused[0].json()["error"]["message"]
    assert sorted(r.json()["usage"]["completion_tokens"] for r in responses if r.status_code == 200) == [30] * k

    # n counts: one request for more sequences than the backend admits is refused whole.
    response = httpx.post(base_url + "/v1/completions", json={**body, "n": k + 1}, timeout=30)
    assert response.status_code == 429

    # The same over gRPC directly: RESOURCE_EXHAUSTED.
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(engine_pb2.GenerateRequest(
                request_id="too-many", prompt_token_ids=[1, 2],
                sampling_params=engine_pb2.SamplingParams(n=k + 1, max_tokens=1)), timeout=30))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert wait_for(lambda: engine.engine.get_load().num_requests_running == 0)


def backend_metric(stack, name: str) -> float:
    for line in generate_latest(stack.server.metrics.registry).decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_passed_deadline_aborts_a_waiting_request_in_the_engine(stack):
    address, engine = stack.address, stack.engine
    blocks = engine.engine.block_manager
    expired_before = backend_metric(stack, "tandem:request_deadline_expired_total")

    async def run() -> tuple:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            # Fill the running slots for a while, then queue one with a short deadline behind them.
            busy = [stub.Generate(engine_pb2.GenerateRequest(
                request_id=f"busy-{i}", prompt_token_ids=[7, 8, 9],
                sampling_params=engine_pb2.SamplingParams(max_tokens=40, ignore_eos=True))) for i in range(2)]
            first = [await call.read() for call in busy]
            late = stub.Generate(engine_pb2.GenerateRequest(
                request_id="late", prompt_token_ids=[4, 5, 6],
                sampling_params=engine_pb2.SamplingParams(max_tokens=5)), timeout=0.3)
            try:
                async for _ in late:
                    pass
            except grpc.aio.AioRpcError as error:
                code = error.code()
            for call in busy:
                call.cancel()
            return code, first

    before = engine.engine.num_generation_tokens_total
    code, first = asyncio.run(asyncio.wait_for(run(), 60))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert all(r.new_token_ids for r in first)
    assert wait_for(lambda: blocks.num_free_blocks == blocks.num_blocks, 5)
    assert "late" not in engine.engine.children
    assert engine.engine.num_generation_tokens_total - before < 2 * 40 + 5
    # Counted when the call's handler ends, which can be just after the engine freed the blocks.
    assert wait_for(lambda: backend_metric(stack, "tandem:request_deadline_expired_total") == expired_before + 1, 5)


def test_the_frontends_request_timeout_reaches_the_engine_and_is_a_504(stack):
    engine = stack.engine
    info = engine.engine.model_info()
    client = GrpcEngineClient(stack.address)
    app = create_app(client, load_tokenizer(info.tokenizer_path), info, limits=Limits(request_timeout_s=1))
    try:
        with uvicorn_on(stack.loop, app) as base_url:
            started = time.monotonic()
            response = httpx.post(base_url + "/v1/completions", timeout=30,
                                  json={"prompt": [1, 2], "max_tokens": 60, "ignore_eos": True})
            assert response.status_code == 504, response.text
            assert response.json()["error"]["type"] == "GatewayTimeoutError"
            assert time.monotonic() - started < 5
    finally:
        stack.loop.run(client.close())
    assert wait_for(lambda: not engine.engine.has_unfinished_requests(), 5)


# ---- the edge before admission: the API key, slow heads and bodies, unauthenticated clients --------


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
def edge_server(tmp_path, api_key: Optional[str] = API_KEY, **limits) -> Iterator[tuple[str, int, QuickEngine]]:
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
