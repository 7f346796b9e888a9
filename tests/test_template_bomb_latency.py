"""Acceptance (issue 23, templates): chat template bombs sent beside a stream of small requests
neither stall the others nor keep memory.

A frontend that allows request templates (``--trust-request-chat-template``) runs in a process of
its own over the tests' fake engine. While a nested-loop template (CPU: it runs until its worker is
killed) and a string-multiplication template (memory: its worker runs out) render, /health and
small chat requests (the model's template) keep their median latency within 2x of their median
alone, every bomb gets a 400 naming chat_template, and the frontend's RSS ends within 50 MB of
what it was before the bombs.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import build_tokenizer
from helpers import free_port, http_status, stop_process, wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 3  # --chat-template-timeout-s of the frontend under test

FRONTEND = """
import sys
sys.path.insert(0, {tests!r})
import uvicorn
from backend.types.limits import Limits
from backend.types.outputs import ModelInfo
from frontend.app import create_app
from frontend.tokenizer import load_tokenizer
from fake_engine import FakeEngine
tokenizer = load_tokenizer({tokenizer!r})
engine = FakeEngine(tokenizer)
limits = Limits(trust_request_chat_template=True, chat_template_timeout_s={timeout_s}, chat_template_workers=2)
app = create_app(engine, tokenizer, ModelInfo("m", 4096, 384, [engine.eos]), limits=limits)
uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning", lifespan="off")
"""

MESSAGES = [{"role": "user", "content": "ab"}]
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
# Not foldable at compile time (it multiplies a message): 600 MB at render time, past the worker's memory cap.
STRING_MULTIPLICATION = "{{ messages[0]['content'] * 300000000 }}"
SMALL_CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended since the listing
            continue
    return children


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    """(base URL, pid) of a frontend that renders request templates in its sandbox."""
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(tokenizer_dir)
    port = free_port()
    source = FRONTEND.format(tests=str(REPO_ROOT / "tests"), tokenizer=str(tokenizer_dir), port=port,
                             timeout_s=TIMEOUT_S)
    process = subprocess.Popen([sys.executable, "-c", source], cwd=REPO_ROOT)
    try:
        assert wait_for(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, 120)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        stop_process(process, 20)


async def small_latencies(http: httpx.AsyncClient, until, max_rounds: int) -> tuple[list[float], list[float]]:
    """/health and small-chat latencies, one of each per round, until ``until()`` or ``max_rounds``."""
    health, chat = [], []
    for _ in range(max_rounds):
        started = time.perf_counter()
        assert (await http.get("/health")).status_code == 200
        health.append(time.perf_counter() - started)
        started = time.perf_counter()
        response = await http.post("/v1/chat/completions", json=SMALL_CHAT)
        assert response.status_code == 200, response.text
        chat.append(time.perf_counter() - started)
        if until():
            break
        await asyncio.sleep(0.02)
    return health, chat


@pytest.mark.timeout(300)
def test_template_bombs_stall_nobody_and_their_memory_returns(frontend):
    base_url, pid = frontend

    async def run() -> dict:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            # Warm up, the sandbox included (its workers start with the app; this waits for them).
            warm = await http.post("/tokenize", json={"messages": MESSAGES,
                                                      "chat_template": "{{ messages[0]['content'] }}"})
            assert warm.status_code == 200 and warm.json()["count"] > 0, warm.text
            await small_latencies(http, lambda: False, 10)
            alone = await small_latencies(http, lambda: False, 40)
            rss_before = rss_bytes(pid)

            async def bomb(route: str, template: str) -> tuple[int, dict, float]:
                body = {"messages": MESSAGES, "chat_template": template}
                started = time.perf_counter()
                response = await http.post(route, json=body)
                return response.status_code, response.json(), time.perf_counter() - started

            bombs = asyncio.ensure_future(asyncio.gather(
                bomb("/v1/chat/completions", NESTED_LOOPS), bomb("/tokenize", STRING_MULTIPLICATION),
                bomb("/tokenize", NESTED_LOOPS), bomb("/v1/chat/completions", STRING_MULTIPLICATION)))
            await asyncio.sleep(0.2)  # the bombs are rendering
            beside = await small_latencies(http, bombs.done, 1000)
            results = await bombs
            await asyncio.sleep(2)  # the retired workers' replacements start
            return dict(alone=alone, beside=beside, results=results, rss_before=rss_before,
                        rss_after=rss_bytes(pid), workers=[rss_bytes(child) for child in descendants(pid)])

    result = asyncio.run(asyncio.wait_for(run(), 240))
    (health_alone, chat_alone), (health_beside, chat_beside) = result["alone"], result["beside"]
    medians = {name: statistics.median(values) * 1e3 for name, values in
               dict(health_alone=health_alone, health_beside=health_beside, chat_alone=chat_alone,
                    chat_beside=chat_beside).items()}
    growth_mb = (result["rss_after"] - result["rss_before"]) / 2**20
    print(f"\nmedian ms: {', '.join(f'{k} {v:.1f}' for k, v in medians.items())}; {len(chat_beside)} rounds beside; "
          f"bombs: {[(status, round(seconds, 2)) for status, _, seconds in result['results']]}; frontend RSS "
          f"{result['rss_before'] / 2**20:.0f} -> {result['rss_after'] / 2**20:.0f} MB; workers' RSS "
          f"{[round(rss / 2**20) for rss in result['workers']]} MB")
    for status, body, seconds in result["results"]:
        assert status == 400 and body["error"]["param"] == "chat_template", body
        assert seconds < TIMEOUT_S + 30  # bounded by the timeout (and, for the second pair, a worker's wait)
    messages = " ".join(body["error"]["message"] for _, body, _ in result["results"])
    assert "--chat-template-timeout-s" in messages and "--max-chat-template-memory-bytes" in messages
    assert len(chat_beside) >= 10  # the small requests ran while the bombs rendered
    assert medians["health_beside"] <= 2 * medians["health_alone"]
    assert medians["chat_beside"] <= 2 * medians["chat_alone"]
    assert abs(growth_mb) < 50
    assert len(result["workers"]) == 2  # the retired workers were replaced, and only those
