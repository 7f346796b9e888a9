"""5,000 concurrent streams through one frontend (tiny max_tokens): none CANCELLED, none a 5xx.

Real processes on loopback: a backend on a tiny random Llama that admits them all (256 running,
the rest queued) and a frontend whose cap admits them all; the client is plain asyncio sockets,
cheap enough to hold 5,000 connections open at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from helpers import free_port, http_status, raw_post, stop_process, wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]
STREAMS = 5000


def test_5000_concurrent_streams_through_one_frontend(tiny_checkpoint, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 3 * STREAMS)), hard))  # children inherit it
    model_dir = tiny_checkpoint("llama")
    grpc_port, http_port = free_port(), free_port()
    env = {**os.environ, "TANDEM_CACHE": str(tmp_path / "cache")}
    log = tmp_path / "stack.log"
    with open(log, "wb") as out:
        backend = subprocess.Popen(
            [sys.executable, "-m", "backend.server", str(model_dir), "--port", str(grpc_port), "--metrics-port", "0",
             "--dtype", "float32", "--max-model-len", "64", "--num-kv-blocks", "2048", "--block-size", "16",
             "--max-num-seqs", "256", "--max-num-queued-requests", str(STREAMS)],
            cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        frontend = subprocess.Popen(
            [sys.executable, "-m", "frontend.server", "--backend", f"127.0.0.1:{grpc_port}", "--port",
             str(http_port), "--log-level", "warning", "--max-concurrent-requests", str(STREAMS)],
            cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        assert wait_for(lambda: http_status(f"http://127.0.0.1:{http_port}/health") == 200, 180), \
            log.read_text(errors="replace")
        body = json.dumps({"prompt": "Hi", "max_tokens": 1, "stream": True, "ignore_eos": True}).encode()

        async def all_at_once() -> Counter:
            results = await asyncio.gather(*(raw_post("127.0.0.1", http_port, "/v1/completions", body, timeout=900)
                                             for _ in range(STREAMS)), return_exceptions=True)
            outcomes: Counter = Counter()
            for result in results:
                if isinstance(result, BaseException):
                    outcomes[f"client error {type(result).__name__}"] += 1
                    continue
                status, payload = result
                if status != 200:
                    outcomes[f"{status}"] += 1
                elif b"[DONE]" not in payload or b'"error"' in payload:
                    outcomes[f"broken stream {payload[-300:]!r}"] += 1
                else:
                    outcomes["ok"] += 1
            return outcomes

        started = time.monotonic()
        outcomes = asyncio.run(asyncio.wait_for(all_at_once(), 900))
        print(f"\n{STREAMS} streams in {time.monotonic() - started:.1f} s: {dict(outcomes)}")
        assert outcomes == Counter({"ok": STREAMS}), outcomes.most_common(5)
        assert "CANCELLED" not in log.read_text(errors="replace")
    finally:
        for process in (frontend, backend):
            stop_process(process)
