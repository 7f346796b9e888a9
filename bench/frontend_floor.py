"""The floor under a frontend's CPU per streamed token: a bare ASGI app on the frontend's HTTP server.

    python bench/frontend_floor.py [--concurrency 32,256] [--max-tokens 64] [--tokens-per-run 32768]

One uvicorn process (httptools, as the frontend runs it) serves an app with no framework, model,
tokenizer or gRPC: a streamed completions request gets ``max_tokens`` SSE events (then the usage
chunk and ``data: [DONE]``), each written after one wake-up of the request's task by one shared
task, as the frontend's multiplexed stream wakes each request once per delta. What it costs per
token is what any frontend in this design pays (a task wake-up, an ASGI ``send`` and one socket
write per event), whatever else it does. It is driven by the same clients as
``frontend_capacity.py`` and its CPU read from /proc the same way (``--json`` writes the rows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontend_capacity import WORKLOADS, drive, free_port, stop  # noqa: E402

_CHUNK_HEAD = 'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"floor","choices":[{"index":0,"text":'
_CHUNK_TAIL = ',"logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}\n\n'


class FloorApp:
    """The bare ASGI app (see the module doc); GET /health answers 200."""

    def __init__(self) -> None:
        self._waiting: list[asyncio.Future] = []
        self._work: Optional[asyncio.Future] = None  # set when a request waits and the waker sleeps
        self._waker: Optional[asyncio.Task] = None

    async def _wake_all(self) -> None:
        """Each loop turn, wake every request waiting for its next token."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._waiting:
                self._work = loop.create_future()
                await self._work
            waiting, self._waiting = self._waiting, []
            for future in waiting:
                future.set_result(None)
            await asyncio.sleep(0)

    async def _next_token(self, loop: asyncio.AbstractEventLoop) -> None:
        future = loop.create_future()
        self._waiting.append(future)
        if self._work is not None and not self._work.done():
            self._work.set_result(None)
        await future

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if self._waker is None:
            self._waker = asyncio.ensure_future(self._wake_all())
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        num_tokens = int(json.loads(body).get("max_tokens", 16))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        loop = asyncio.get_running_loop()
        for _ in range(num_tokens):
            await self._next_token(loop)
            event = _CHUNK_HEAD + json.dumps(" tok") + _CHUNK_TAIL
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        end = 'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % num_tokens
        await send({"type": "http.response.body", "body": end.encode(), "more_body": False})


def serve(port: int) -> None:
    import uvicorn

    uvicorn.run(FloorApp(), host="127.0.0.1", port=port, http="httptools", log_level="warning", lifespan="on")


def start_floor(timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise RuntimeError("the floor app did not start") from None
            time.sleep(0.1)


def measure(concurrencies: list[int], max_tokens: int, tokens_per_run: int) -> list[dict]:
    """One row per concurrency: the app process's CPU µs per streamed token (and the kernel's share)."""
    proc, url = start_floor()
    rows = []
    try:
        for concurrency in concurrencies:
            num_requests = max(concurrency, tokens_per_run // max_tokens)
            result = asyncio.run(drive(url, "floor", WORKLOADS["completions-stream"], concurrency, num_requests,
                                       max_tokens, proc.pid, proc.pid))
            rows.append({"concurrency": concurrency, "requests": num_requests, "tokens": result.tokens,
                         "us_per_token": round(1e6 * result.frontend_cpu_s / result.tokens, 1),
                         "sys_us_per_token": round(1e6 * result.frontend_sys_s / result.tokens, 1),
                         "tokens_per_s": round(result.tokens / result.wall_s)})
    finally:
        stop(proc)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="32,256", help="concurrent clients, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64, help="events per request")
    parser.add_argument("--tokens-per-run", type=int, default=32768, help="about this many tokens per concurrency")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the app's own process
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
    print(f"{'C':>4} {'reqs':>5} {'tokens':>7} {'µs/tok':>7} {'(sys)':>6} {'tok/s':>7}")
    rows = measure([int(c) for c in args.concurrency.split(",")], args.max_tokens, args.tokens_per_run)
    for row in rows:
        print(f"{row['concurrency']:>4} {row['requests']:>5} {row['tokens']:>7} {row['us_per_token']:>7.1f} "
              f"{row['sys_us_per_token']:>6.1f} {row['tokens_per_s']:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_average": os.getloadavg()[0], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
