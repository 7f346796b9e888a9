"""Real backend processes: exclusive ports that fail fast, and the router over two backends.

Backends run as `python -m backend.server` on a tiny random Llama; the router runs in
this process. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from helpers import free_port
from prometheus_client.parser import text_string_to_metric_families

from backend.types.sampling_params import SamplingParams
from frontend.router import Router, parse_targets

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "256"]
STARTUP_TIMEOUT_S = 240  # a loaded 2-core machine can take minutes to import torch


class BackendProcess:
    def __init__(self, model_dir: Path, log: Path, port: int = 0, metrics_port: int = 0,
                 extra: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log = log
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "backend.server", str(model_dir), "--host", "127.0.0.1", "--port",
                 str(self.port), "--metrics-port", str(self.metrics_port), *ENGINE_FLAGS, *extra],
                cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)

    def wait_serving(self) -> "BackendProcess":
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while f"on 127.0.0.1:{self.port}" not in self.log.read_text(errors="replace"):
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)
        return self

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# ---- ports --------------------------------------------------------------------------------------


def held_port() -> socket.socket:
    """A listening socket on a free loopback port (the port taken by 'someone else')."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


def test_a_backend_port_in_use_fails_fast_naming_the_flag(tmp_path):
    with held_port() as holder:
        port = holder.getsockname()[1]
        started = time.monotonic()
        # A model that does not exist: the port is checked first, before any model is looked at.
        result = subprocess.run([sys.executable, "-m", "backend.server", str(tmp_path / "no-model"), "--host",
                                 "127.0.0.1", "--port", str(port)], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: Port {port} on 127.0.0.1 is already in use; choose another with --port."]
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("flag", ["--port", "--grpc-port", "--metrics-port"])
def test_serve_checks_every_port_it_opens_before_starting(flag, tmp_path):
    ports = {"--port": free_port(), "--grpc-port": free_port(), "--metrics-port": free_port()}
    with held_port() as holder:
        ports[flag] = holder.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "frontend.entrypoints.cli", "serve", str(tmp_path / "no-model"),
                                 *[str(x) for pair in ports.items() for x in pair]], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"already in use; choose another with {flag}." in result.stderr
    assert "no-model" not in result.stderr  # nothing started


def test_the_grpc_port_is_exclusive_a_second_backend_is_refused_and_connections_age(tiny_checkpoint, tmp_path):
    first = BackendProcess(tiny_checkpoint("llama"), tmp_path / "first.log",
                           extra=("--max-connection-age", "1")).wait_serving()
    try:
        # --max-connection-age: the server ends a connection after ~1 s, so the client reconnects
        # (behind a balancer or a DNS name, possibly to a new replica).
        states: list[grpc.ChannelConnectivity] = []
        channel = grpc.insecure_channel(f"127.0.0.1:{first.port}")
        channel.subscribe(states.append, try_to_connect=True)
        grpc.channel_ready_future(channel).result(timeout=10)
        deadline = time.monotonic() + 10
        while grpc.ChannelConnectivity.IDLE not in states[states.index(grpc.ChannelConnectivity.READY):]:
            assert time.monotonic() < deadline, states
            time.sleep(0.1)
        channel.close()

        # gRPC's default SO_REUSEPORT would let this server share the port: ours forbids it.
        intruder = grpc.server(ThreadPoolExecutor(1))
        with pytest.raises(RuntimeError):
            intruder.add_insecure_port(f"127.0.0.1:{first.port}")
        second = subprocess.run([sys.executable, "-m", "backend.server", str(tiny_checkpoint("llama")), "--host",
                                 "127.0.0.1", "--port", str(first.port), "--metrics-port", "0"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "--port" in second.stderr
        assert first.process.poll() is None
    finally:
        first.stop()


# ---- the router over two real backends ------------------------------------------------------------


def test_router_keeps_a_prefix_on_one_backend_fails_over_and_takes_a_backend_back(tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("llama")
    backends = [BackendProcess(model, tmp_path / f"b{i}.log") for i in range(2)]
    for backend in backends:
        backend.wait_serving()
    by_address = {f"127.0.0.1:{b.port}": b for b in backends}

    async def generate(router: Router, request_id: str, prompt: list[int]) -> int:
        outputs = [o async for o in router.generate(request_id, prompt, SamplingParams(max_tokens=3))]
        return sum(len(o.new_token_ids) for o in outputs)

    async def scenario():
        router = Router(parse_targets(",".join(by_address)), check_interval=0.5)
        await router.start()
        try:
            deadline = time.monotonic() + 30
            while sum(b.usable for b in router.backends.values()) < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            shared = [(7 * i) % 300 + 10 for i in range(96)]  # 96 tokens: six 16-token blocks
            before = {a: b.metric("tandem:prefix_cache_hits_total") for a, b in by_address.items()}
            for i in range(10):
                assert await generate(router, f"p{i}", shared + [i + 1, i + 2]) == 3
            hits = {a: b.metric("tandem:prefix_cache_hits_total") - before[a] for a, b in by_address.items()}
            owner = router.choose(shared)[0].address
            other = next(a for a in by_address if a != owner)

            by_address[owner].stop(signal.SIGKILL)  # dies: no drain, no goodbye
            killed_at = time.monotonic()
            assert await generate(router, "after-kill", shared) == 3  # retried on the other at once
            failover_s = time.monotonic() - killed_at
            assert router.choose(shared)[0].address == other

            revived = BackendProcess(model, tmp_path / "revived.log", port=int(owner.rsplit(":", 1)[1]))
            revived.wait_serving()
            deadline = time.monotonic() + 15
            while router.choose(shared)[0].address != owner:
                assert time.monotonic() < deadline, "the revived backend was not taken back"
                await asyncio.sleep(0.1)
            assert await generate(router, "back", shared) == 3
            revived.stop()
            return hits, owner, failover_s
        finally:
            await router.close()

    try:
        hits, owner, failover_s = asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        for backend in backends:
            backend.stop()
    assert hits[owner] >= 9 * 96 and sum(hits.values()) == hits[owner]
    assert failover_s < 10
