"""Health tells the truth: a dead engine is NOT_SERVING and 503, the backend exits non-zero, and a
restarted backend is served again by the same frontend (after its tokenizer is checked again).

A failure is injected in an engine step by a "poison" prompt (POISON as the first tokens), in
process for the health check and in a real backend process for the rest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import LoopThread, free_port, stop_process, wait_for
from prometheus_client import generate_latest

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.server.grpc_server import BackendServer
from backend.types.config import EngineConfig
from backend.types.sampling_params import SamplingParams
from frontend.grpc_client import BackendUnavailableError, GrpcEngineClient

REPO_ROOT = Path(__file__).resolve().parents[1]
POISON = [99, 98, 97]
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "4", "--max-model-len", "64"]

# `python -c` source of a backend whose engine step raises when a poison prompt is scheduled.
POISONED_BACKEND = f"""
import sys
from backend.engine import llm_engine
from backend.server import main as server_main
step = llm_engine.LLMEngine.step
def poisoned_step(self):
    if any(list(r.prompt_token_ids[:3]) == {POISON} for r in self.scheduler.requests.values()):
        raise RuntimeError("injected engine failure")
    return step(self)
llm_engine.LLMEngine.step = poisoned_step
sys.exit(server_main.main(sys.argv[1:]))
"""


def poison_steps(engine: AsyncLLMEngine) -> None:
    step = engine.engine.step

    def poisoned_step():
        if any(r.prompt_token_ids[:3] == POISON for r in engine.engine.scheduler.requests.values()):
            raise RuntimeError("injected engine failure")
        return step()

    engine.engine.step = poisoned_step


def test_a_dead_engine_turns_health_not_serving_and_counts_the_error(tiny_checkpoint):
    loop = LoopThread()
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=32,
                                         block_size=4, max_model_len=64))
    poison_steps(engine)
    server = BackendServer(engine, "127.0.0.1", 0)
    loop.run(server.start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            serving = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert serving == health_pb2.HealthCheckResponse.SERVING
            from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

            stub = engine_pb2_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(engine_pb2.GenerateRequest(request_id="poison", prompt_token_ids=POISON),
                                   timeout=10))
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "injected engine failure" in error.value.details()
            started = time.monotonic()
            for service in ("", "tandem.engine.v1.EngineService"):
                assert wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                                .status == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
            assert time.monotonic() - started < 5
            assert server.engine_died.is_set()
        metrics = generate_latest(server.metrics.registry).decode()
        assert "tandem:engine_errors_total" in metrics and any(
            line.startswith("tandem:engine_errors_total{") and line.endswith(" 1.0") for line in metrics.splitlines())
    finally:
        loop.run(server.stop(0))
        engine.shutdown()
        loop.close()


# ---- real processes -------------------------------------------------------------------------------


def start(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


def start_backend(model_dir: Path, port: int, log: Path, env: dict, poisoned: bool = False) -> subprocess.Popen:
    """A backend process, once it serves; ``log`` must be a new file."""
    head = [sys.executable, "-c", POISONED_BACKEND] if poisoned else [sys.executable, "-m", "backend.server"]
    process = start([*head, str(model_dir), "--port", str(port), "--metrics-port", "0", *ENGINE_FLAGS], log, env)
    assert wait_for(lambda: "Backend serving" in log.read_text(errors="replace") or process.poll() is not None, 120)
    assert process.poll() is None, log.read_text(errors="replace")
    return process


def health_status(base_url: str) -> int:
    try:
        return httpx.get(base_url + "/health", timeout=3).status_code
    except httpx.HTTPError:
        return 0


def complete(base_url: str, prompt) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3}, timeout=30)


def test_backend_death_exit_and_restart_behind_the_same_frontend(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    env = {**os.environ, "TANDEM_CACHE": str(tmp_path / "cache")}
    grpc_port, http_port = free_port(), free_port()
    base_url = f"http://127.0.0.1:{http_port}"
    frontend_log = tmp_path / "frontend.log"
    backend_log = tmp_path / "backend-0.log"
    backend = start_backend(model_dir, grpc_port, backend_log, env, poisoned=True)
    frontend = start([sys.executable, "-m", "frontend.server", "--backend", f"127.0.0.1:{grpc_port}",
                      "--port", str(http_port)], frontend_log, env)
    try:
        assert wait_for(lambda: health_status(base_url) == 200, 60), frontend_log.read_text(errors="replace")
        assert complete(base_url, "Hello").status_code == 200

        # The engine dies on a step: 503 for the request, /health 503, the backend exits non-zero.
        response = complete(base_url, POISON)
        assert response.status_code == 503, response.text
        died = time.monotonic()
        assert wait_for(lambda: health_status(base_url) == 503, 5)
        assert backend.wait(10) != 0
        assert time.monotonic() - died < 10
        assert "exiting so that a supervisor restarts the backend" in backend_log.read_text(errors="replace")
        assert complete(base_url, "Hello").status_code == 503

        # Restarted on the same port: the same frontend serves again.
        backend = start_backend(model_dir, grpc_port, tmp_path / "backend-1.log", env)
        assert wait_for(lambda: health_status(base_url) == 200, 15), frontend_log.read_text(errors="replace")
        assert complete(base_url, "Hello").status_code == 200
    finally:
        stop_process(frontend)
        stop_process(backend)


def test_a_backend_back_with_another_tokenizer_is_refused_until_the_right_one_returns(tiny_checkpoint, tmp_path):
    """In process: GrpcEngineClient re-checks the fingerprint whenever its channel reconnects."""
    model_dir = tiny_checkpoint("llama")
    other = tmp_path / "other-tokenizer"
    shutil.copytree(model_dir, other)
    config = other / "tokenizer_config.json"
    config.write_text(config.read_text().replace("im_start", "im_begin"))
    engines = {path: AsyncLLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=32, block_size=4,
                                                 max_model_len=64)) for path in (model_dir, other)}
    loop = LoopThread()
    port = free_port()
    client = GrpcEngineClient(f"127.0.0.1:{port}")

    def serve(path: Path) -> BackendServer:
        server = BackendServer(engines[path], "127.0.0.1", port)
        loop.run(server.start())
        return server

    async def generate() -> str:
        try:
            async for output in client.generate(f"r-{time.monotonic_ns()}", [1, 2, 3], SamplingParams(max_tokens=1)):
                pass
            return "ok"
        except BackendUnavailableError as error:
            return str(error)

    def until(condition, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    try:
        server = serve(model_dir)
        client.expect_tokenizer(loop.run(client.tokenizer_fingerprint()))
        assert loop.run(client.health()) and loop.run(generate()) == "ok"
        loop.run(server.stop(0))
        server = serve(other)
        until(lambda: "different tokenizer" in loop.run(generate()))
        assert not loop.run(client.health())
        loop.run(server.stop(0))
        server = serve(model_dir)
        until(lambda: loop.run(generate()) == "ok")
        assert loop.run(client.health())
    finally:
        loop.run(client.close())
        loop.run(server.stop(0))
        for engine in engines.values():
            engine.shutdown()
        loop.close()
