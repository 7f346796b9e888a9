"""The packaging split: the base install is a frontend with no torch; `tandem[backend]` adds the engine.

A frontend-only install is checked two ways: the base requirements' closure (from
the installed metadata) holds no torch, and a frontend whose process cannot import
torch starts against a real backend and serves completions and a streamed chat.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from helpers import free_port, http_status

REPO_ROOT = Path(__file__).resolve().parents[1]
TORCH_LIKE = {"torch", "triton", "torchvision", "ray"}  # what a frontend image must not carry
# Run as `python -c BLOCK_TORCH ARGS...`: torch (and friends) cannot be imported in that process.
BLOCK_TORCH = ("import sys; sys.modules.update(dict.fromkeys({names!r})); "
               "from {module} import main; sys.exit(main(sys.argv[1:]))")
STARTUP_TIMEOUT_S = 240  # a loaded 2-core machine can take minutes to import torch


def blocked_torch_command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-c", BLOCK_TORCH.format(names=sorted(TORCH_LIKE), module=module), *args]


def requirement_closure(name: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """Every distribution that installing ``name[extras]`` pulls in, from the installed metadata."""
    seen: set[str] = set()
    pending = [(canonicalize_name(name), extras)]
    while pending:
        dist_name, dist_extras = pending.pop()
        if dist_name in seen and not dist_extras:
            continue
        seen.add(dist_name)
        try:
            requires = importlib.metadata.requires(dist_name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional platform dependency that is not installed here
        for line in requires:
            requirement = Requirement(line)
            environment = [{"extra": extra} for extra in dist_extras] or [{"extra": ""}]
            if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environment):
                pending.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return seen


def test_the_base_install_pulls_in_no_torch_and_the_backend_extra_does():
    base = requirement_closure("tandem")
    assert {"grpcio", "fastapi", "transformers", "tokenizers"} <= base
    assert not base & TORCH_LIKE, f"the frontend install would pull in {sorted(base & TORCH_LIKE)}"
    assert "torch" in requirement_closure("tandem", frozenset({"backend"}))


def test_engine_commands_refuse_clearly_without_torch():
    result = subprocess.run(blocked_torch_command("frontend.entrypoints.cli", "serve"), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "tandem[backend]" in result.stderr and "frontend-only install" in result.stderr


def test_a_frontend_that_cannot_import_torch_serves(tiny_checkpoint, tmp_path):
    env = {**os.environ, "TANDEM_CACHE": str(tmp_path / "cache")}
    backend_log, frontend_log = tmp_path / "backend.log", tmp_path / "frontend.log"
    grpc_port, http_port = free_port(), free_port()
    with open(backend_log, "wb") as out:
        backend = subprocess.Popen(
            [sys.executable, "-m", "backend.server", str(tiny_checkpoint("llama")), "--host", "127.0.0.1",
             "--port", str(grpc_port), "--metrics-port", "0", "--dtype", "float32", "--num-kv-blocks", "64",
             "--max-model-len", "128"], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    with open(frontend_log, "wb") as out:
        frontend = subprocess.Popen(
            blocked_torch_command("frontend.server", "--backend", f"127.0.0.1:{grpc_port}",
                                  "--port", str(http_port)),
            cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while http_status(f"http://127.0.0.1:{http_port}/health") != 200:
            assert frontend.poll() is None, frontend_log.read_text()
            assert time.monotonic() < deadline, frontend_log.read_text() + backend_log.read_text()
            time.sleep(0.2)

        def post(path: str, body: dict) -> str:
            request = urllib.request.Request(f"http://127.0.0.1:{http_port}{path}", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.read().decode()

        completion = json.loads(post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5}))
        assert completion["usage"]["completion_tokens"] == 5
        stream = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                               "stream": True})
        assert re.findall(r"^data: (.*)$", stream, re.MULTILINE)[-1] == "[DONE]"
    finally:
        for process in (frontend, backend):
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert frontend.returncode == 0, frontend_log.read_text()
