"""Admission control and deadlines: a full server refuses the excess at once (HTTP 429 with
Retry-After, gRPC RESOURCE_EXHAUSTED) and serves the rest; a deadline reaches the engine. The edge
before admission (API key, slow heads and bodies): tests/test_edge_limits.py.

The frontend's cap is tested over a fake engine that holds every stream open until told; the
backend's over a tiny random Llama whose steps are slowed down, through the real frontend.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

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
