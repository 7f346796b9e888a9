"""A 64-stream soak of the real stack (backend and frontend processes, a tiny random Llama): for
``TANDEM_SOAK_SECONDS`` (default 300) 64 clients send mixed traffic without pause. Every request
must succeed, the backend must end idle with no ERROR logged, and, in a soak of at least 5 minutes
(the issue's), its RSS after the warm-up may grow at most 5 %.

Marked ``soak``: the README's test command leaves it out; ``.ci/run`` runs it on its own, the
full 5 minutes. A shorter ``TANDEM_SOAK_SECONDS`` checks the errors and the idle end only. The
backend's RSS used to grow ~1 MB/s here (oneDNN's primitive caches, one entry per batch row
count); backend/models/linear_methods.py bounds them and RSS is now flat after ~10 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import free_port, http_status, raw_post, stop_process, wait_for

pytestmark = [pytest.mark.soak, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parents[1]
SOAK_SECONDS = float(os.environ.get("TANDEM_SOAK_SECONDS", "300"))
WARMUP_SECONDS = min(60.0, SOAK_SECONDS / 5)
RSS_BOUND_MIN_SECONDS = 300  # the RSS bound is the issue's, over a soak of 5 minutes or more
STREAMS = 64
PROMPTS = ["The capital of France is", "Once upon a time, a small model", "def add(a, b):",
           "Tandem serves language models with a paged KV cache and continuous batching. " * 4]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def request_body(rng: random.Random) -> tuple[str, dict]:
    """One request of the mix: completions or chat, streamed or not, n 1-2, a stop string now and
    then, prompts that share prefixes (and some that do not)."""
    stream = rng.random() < 0.5
    common = {"max_tokens": rng.randint(4, 16), "stream": stream, "temperature": rng.choice([0.0, 0.8]),
              "seed": rng.randint(0, 1000), "n": rng.choice([1, 1, 1, 2])}
    if rng.random() < 0.2:
        common["stop"] = ["e"]
    prompt = f"{rng.choice(PROMPTS)} {rng.randint(0, 10**6)}"
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": prompt}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}


async def post_and_hang_up(port: int, path: str, body: bytes) -> bool:
    """Start a streamed request, read its first event, then go away (the server must abort it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"data: "), 120)
        return head.startswith(b"HTTP/1.1 200")
    finally:
        writer.close()


def test_64_stream_soak(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    env = {**os.environ, "TANDEM_CACHE": str(tmp_path / "cache")}
    backend_log, frontend_log = tmp_path / "backend.log", tmp_path / "frontend.log"
    with open(backend_log, "wb") as out:
        backend = subprocess.Popen(
            [sys.executable, "-m", "backend.server", str(model_dir), "--port", str(grpc_port),
             "--metrics-port", str(metrics_port), "--dtype", "float32", "--max-model-len", "256",
             "--num-kv-blocks", "512", "--block-size", "16", "--max-num-seqs", str(STREAMS)],
            cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    with open(frontend_log, "wb") as out:
        frontend = subprocess.Popen(
            [sys.executable, "-m", "frontend.server", "--backend", f"127.0.0.1:{grpc_port}",
             "--port", str(http_port), "--log-level", "warning"],
            cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        assert wait_for(lambda: http_status(f"http://127.0.0.1:{http_port}/health") == 200, 180), \
            backend_log.read_text(errors="replace") + frontend_log.read_text(errors="replace")
        outcomes: Counter = Counter()
        samples: list[tuple[float, int]] = []

        async def client(index: int, until: float) -> None:
            rng = random.Random(index)
            while time.monotonic() < until:
                path, body = request_body(rng)
                if body["stream"] and rng.random() < 0.1:
                    body["max_tokens"] = 64
                    ok = await post_and_hang_up(http_port, path, json.dumps(body).encode())
                    outcomes["ok" if ok else "hang-up request refused"] += 1
                    continue
                status, payload = await raw_post("127.0.0.1", http_port, path, json.dumps(body).encode())
                ok = status == 200 and b'"error"' not in payload and (not body["stream"] or b"[DONE]" in payload)
                outcomes["ok" if ok else f"{status}: {payload[:200]!r}"] += 1

        async def sample_rss(until: float) -> None:
            start = time.monotonic()
            while time.monotonic() < until:
                samples.append((time.monotonic() - start, rss_bytes(backend.pid)))
                await asyncio.sleep(5)

        async def soak() -> None:
            until = time.monotonic() + SOAK_SECONDS
            await asyncio.gather(sample_rss(until), *(client(i, until) for i in range(STREAMS)))

        asyncio.run(asyncio.wait_for(soak(), SOAK_SECONDS + 120))
        assert set(outcomes) == {"ok"}, outcomes.most_common(5)
        warm = [rss for t, rss in samples if t >= WARMUP_SECONDS]
        growth = warm[-1] / warm[0] - 1
        print(f"\nsoak: {outcomes['ok']} requests in {SOAK_SECONDS:.0f} s, backend RSS "
              f"{warm[0] / 2**20:.0f} -> {warm[-1] / 2**20:.0f} MiB after warm-up ({growth:+.1%}), "
              f"max {max(warm) / 2**20:.0f} MiB")
        print("backend RSS (s, MiB): " + " ".join(f"{t:.0f}:{rss / 2**20:.0f}" for t, rss in samples))

        def load() -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
                return {sample.name: sample.value for family in text_string_to_metric_families(response.read().decode())
                        for sample in family.samples}

        idle = ("tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc")
        assert wait_for(lambda: all(load()[name] == 0 for name in idle), 10), load()
        log = backend_log.read_text(errors="replace")
        assert " ERROR " not in log and "never retrieved" not in log, log[-3000:]
        if SOAK_SECONDS >= RSS_BOUND_MIN_SECONDS:
            assert growth <= 0.05, f"backend RSS grew {growth:+.1%} after the warm-up"
    finally:
        for process in (frontend, backend):
            stop_process(process)
