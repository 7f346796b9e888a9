"""The parts of a streamed token's CPU in the frontend, each alone (``frontend_capacity.py --parts``).

The app (middleware, endpoint, detokenization, SSE chunks) through ASGI on an in-process
stand-in engine, and the gRPC client reading the stand-in backend's streams; the whole frontend
process's figure minus these two is the HTTP server and the sockets.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from frontend_capacity import REPO_ROOT, Workload, requests_for, start_stand_in, stop


async def _asgi_request(app, path: str, body: bytes) -> int:
    """One request straight into the ASGI app (no socket, no HTTP server); returns the bytes it sent."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "state": {},
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    done = asyncio.Event()
    delivered = False
    sent = 0

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal sent
        sent += len(message.get("body", b""))

    await app(scope, receive, send)
    done.set()
    return sent


async def _concurrently(concurrency: int, num_requests: int, one) -> float:
    """``num_requests`` calls of ``one()`` from ``concurrency`` loops; the CPU seconds they took."""
    remaining = num_requests

    async def loop() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await one()

    await asyncio.gather(*(one() for _ in range(concurrency)))  # warm-up
    before = time.process_time()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return time.process_time() - before


def measure_parts(tokenizer_dir: str, workloads: list[Workload], concurrencies: list[int], max_tokens: int,
                  tokens_per_run: int, report=print) -> list[dict]:
    """Where a streamed token's CPU goes, part by part, in this process:

    - ``app``: the frontend's app (middleware, endpoint, detokenization, SSE chunks) called
      directly through ASGI on an in-process stand-in engine: no socket, no HTTP server, no gRPC;
    - ``grpc``: the frontend's gRPC client alone (``GrpcEngineClient.generate``) reading the
      stand-in backend's streams, nothing done with them: with Generate (one message per token
      per request) and with GenerateStream (the default: one message per step of every request).

    The whole frontend process's figure minus these two is the HTTP server and sockets."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    sys.path.insert(0, str(REPO_ROOT))
    from stand_in_backend import StandInEngineClient, StandInServicer

    from backend.types.sampling_params import SamplingParams
    from frontend.app import create_app
    from frontend.grpc_client import GrpcEngineClient
    from frontend.tokenizer import load_tokenizer

    servicer = StandInServicer(tokenizer_dir)
    engine = StandInEngineClient(servicer)
    tokenizer = load_tokenizer(tokenizer_dir)
    rows = []
    for workload in workloads:
        if not workload.stream:
            continue
        body = json.dumps(workload.body("stand-in", max_tokens)).encode()
        for concurrency in concurrencies:
            num_requests = requests_for(workload, concurrency, tokens_per_run, max_tokens)

            async def run_app() -> float:
                app = create_app(engine, tokenizer, await engine.model_info())
                try:
                    return await _concurrently(concurrency, num_requests,
                                               lambda: _asgi_request(app, workload.path, body))
                finally:
                    app.state.serving.close()

            cpu = asyncio.run(run_app())
            rows.append({"part": "app", "workload": workload.name, "concurrency": concurrency,
                         "us_per_token": round(1e6 * cpu / (num_requests * max_tokens), 1)})
            report(f"{'app (in-process ASGI)':<24} {workload.name:<28} {concurrency:>4} {rows[-1]['us_per_token']:>8.1f}")
    stand_in, port = start_stand_in(tokenizer_dir)
    try:
        for rpc, multiplexed in (("Generate", False), ("GenerateStream", True)):
            for concurrency in concurrencies:
                num_requests = max(concurrency, tokens_per_run // max_tokens)
                params = SamplingParams(max_tokens=max_tokens)
                counter = iter(range(1 << 30))

                async def run_grpc() -> float:
                    client = GrpcEngineClient(f"127.0.0.1:{port}", multiplexed=multiplexed)

                    async def one() -> None:
                        async for _ in client.generate(f"r{next(counter)}", [1, 2, 3], params):
                            pass

                    try:
                        return await _concurrently(concurrency, num_requests, one)
                    finally:
                        await client.close()

                cpu = asyncio.run(run_grpc())
                rows.append({"part": "grpc", "workload": rpc, "concurrency": concurrency,
                             "us_per_token": round(1e6 * cpu / (num_requests * max_tokens), 1)})
                report(f"{'grpc client alone':<24} {rpc:<28} {concurrency:>4} {rows[-1]['us_per_token']:>8.1f}")
    finally:
        stop(stand_in)
    return rows
