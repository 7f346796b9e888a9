"""One huge input never stalls the other clients of a frontend: small requests sent while a 20 MB
prompt (refused before tokenizing) and a big prompt the context admits (tokenized off the event
loop) are in flight keep their median latency within 2x of their median alone.

The frontend runs in a process of its own over the tests' fake engine (fake_engine.FakeEngine),
so the test client's work never competes with it for the GIL.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import build_tokenizer
from helpers import free_port, http_status, wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]
BIG_CONTEXT = 400_000  # tokens the frontend admits: a 200,000-character prompt is tokenized, 20 MB is not

FRONTEND = """
import sys
sys.path.insert(0, {tests!r})
import uvicorn
from backend.types.outputs import ModelInfo
from frontend.app import create_app
from frontend.tokenizer import load_tokenizer
from fake_engine import FakeEngine
tokenizer = load_tokenizer({tokenizer!r})
engine = FakeEngine(tokenizer)
app = create_app(engine, tokenizer, ModelInfo("m", {max_model_len}, 384, [engine.eos]))
uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning", lifespan="off")
"""


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    """base URL -> a frontend process over a fake engine with a context of BIG_CONTEXT tokens."""
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(tokenizer_dir)
    port = free_port()
    source = FRONTEND.format(tests=str(REPO_ROOT / "tests"), tokenizer=str(tokenizer_dir), port=port,
                             max_model_len=BIG_CONTEXT)
    process = subprocess.Popen([sys.executable, "-c", source], cwd=REPO_ROOT)
    try:
        assert wait_for(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, 120)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(20)


async def small_latencies(http: httpx.AsyncClient, count: int, interval: float) -> list[float]:
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        response = await http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4})
        assert response.status_code == 200
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(interval)
    return latencies


def test_small_requests_keep_their_latency_beside_huge_prompts(frontend):
    huge = json.dumps({"prompt": "Hello world " * (20 * 2**20 // 12), "max_tokens": 4}).encode()
    admitted = json.dumps({"prompt": "The capital of France is Paris. " * 6_250}).encode()  # 200,000 chars

    async def run() -> dict:
        async with httpx.AsyncClient(base_url=frontend, timeout=120) as http:
            await small_latencies(http, 5, 0.01)  # warm up
            alone = await small_latencies(http, 30, 0.02)

            async def big(body: bytes, route: str) -> tuple[int, float]:
                started = time.perf_counter()
                response = await http.post(route, content=body, headers={"content-type": "application/json"})
                return response.status_code, time.perf_counter() - started

            bigs = asyncio.gather(big(huge, "/v1/completions"), big(admitted, "/tokenize"))
            beside = await small_latencies(http, 30, 0.02)
            (huge_status, huge_s), (admitted_status, admitted_s) = await bigs
            return dict(alone=alone, beside=beside, huge_status=huge_status, huge_s=huge_s,
                        admitted_status=admitted_status, admitted_s=admitted_s)

    result = asyncio.run(asyncio.wait_for(run(), 300))
    alone, beside = statistics.median(result["alone"]), statistics.median(result["beside"])
    print(f"\nsmall requests: median {alone * 1e3:.1f} ms alone, {beside * 1e3:.1f} ms beside a 20 MB prompt "
          f"({result['huge_s']:.2f} s, {result['huge_status']}) and a 200,000-character /tokenize "
          f"({result['admitted_s']:.2f} s, {result['admitted_status']}); max beside {max(result['beside']) * 1e3:.0f} ms")
    assert result["huge_status"] == 400  # longer than any prompt the context holds: refused before tokenizing
    assert result["admitted_status"] == 200
    assert beside <= 2 * alone
