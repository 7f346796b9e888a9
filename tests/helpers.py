"""Small helpers shared by the tests that run servers, as processes or in process (import as ``helpers``).

Every wait is bounded; servers listen on 127.0.0.1 with ports from the OS.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Iterator, Optional

import uvicorn


def free_port() -> int:
    """A port the OS just gave out on 127.0.0.1 (free unless someone takes it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM a child that still runs, then SIGKILL it if it has not exited within ``timeout`` s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def http_status(url: str) -> Optional[int]:
    """The status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


class LoopThread:
    """An event loop on a daemon thread: a server and its engine live there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@contextmanager
def uvicorn_on(loop: LoopThread, app, **config) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 from ``loop`` (where its engine client lives); yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           lifespan="off", **config))
    served = asyncio.run_coroutine_threadsafe(server.serve(), loop.loop)
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and not served.done(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        served.result(timeout=15)


@contextmanager
def backend_and_frontend(loop: LoopThread, engine, limits=None) -> Iterator[tuple]:
    """``engine`` behind the backend's gRPC server and a frontend app over it (GrpcEngineClient), both
    on ``loop``: yields (server, gRPC address, HTTP base URL); stops both, not the engine."""
    from backend.server.grpc_server import BackendServer
    from frontend.app import create_app
    from frontend.grpc_client import GrpcEngineClient
    from frontend.tokenizer import load_tokenizer

    server = BackendServer(engine, "127.0.0.1", 0, limits=limits)
    loop.run(server.start())
    address = f"127.0.0.1:{server.port}"
    info = engine.engine.model_info()
    client = GrpcEngineClient(address, limits)
    app = create_app(client, load_tokenizer(info.tokenizer_path), info, limits=limits)
    try:
        with uvicorn_on(loop, app) as base_url:
            yield server, address, base_url
    finally:
        loop.run(client.close())
        loop.run(server.stop(0))


@contextmanager
def tiny_llama_backend(checkpoint, limits, **config) -> Iterator[tuple]:
    """An AsyncLLMEngine (fp32, 64 KV blocks of 4, 64 positions, 4 sequences; ``config`` overrides
    or adds EngineConfig fields) over the tiny Llama at ``checkpoint``, behind the backend's gRPC
    server on a loop of its own: yields (engine, loop, server, limits); stops all of them."""
    from backend.engine.async_llm_engine import AsyncLLMEngine
    from backend.server.grpc_server import BackendServer
    from backend.types.config import EngineConfig

    loop = LoopThread()
    engine = AsyncLLMEngine(EngineConfig(**{"model": str(checkpoint), "dtype": "float32", "num_kv_blocks": 64,
                                            "block_size": 4, "max_model_len": 64, "max_num_seqs": 4, **config}),
                            limits)
    server = BackendServer(engine, "127.0.0.1", 0, limits=limits)
    loop.run(server.start())
    try:
        yield engine, loop, server, limits
    finally:
        loop.run(server.stop(0))
        engine.shutdown()
        loop.close()


def wait_for(condition, timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


async def raw_post(host: str, port: int, path: str, body: bytes, timeout: float = 120.0) -> tuple[int, bytes]:
    """POST over a fresh connection with plain asyncio streams (cheap enough for thousands at once);
    returns the status and the whole body (the server closes the connection)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


def tiny_llama_1k_engine(checkpoint, model_dir, num_kv_blocks: int = 1024):
    """An AsyncLLMEngine (fp32) over the tiny random Llama at ``checkpoint``, copied to ``model_dir``
    with 1,024 positions (room for a tools' system prompt, long in the tiny vocabulary)."""
    import json
    import shutil

    from backend.engine.async_llm_engine import AsyncLLMEngine
    from backend.types.config import EngineConfig

    shutil.copytree(checkpoint, model_dir, dirs_exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (model_dir / "config.json").write_text(json.dumps(config))
    return AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=num_kv_blocks,
                                       block_size=4, max_model_len=1024, max_num_seqs=4))


@contextmanager
def tiny_llama_stack(checkpoint, model_dir) -> Iterator[str]:
    """``tiny_llama_1k_engine`` served behind a gRPC backend and a frontend; yields the frontend's
    base URL."""
    loop = LoopThread()
    engine = tiny_llama_1k_engine(checkpoint, model_dir)
    try:
        with backend_and_frontend(loop, engine) as (_, _, base_url):
            yield base_url
    finally:
        engine.shutdown()
        loop.close()
