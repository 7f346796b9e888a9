"""The Node.js examples in protos/examples, run with node against a backend serving the tiny Llama:
what they print equals what the engine gives the same request in process. They need node and the
examples' packages (`npm install` in protos/examples, which .ci/run does)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import tiny_llama_backend

from backend.types.limits import Limits
from backend.types.pooling import PoolingParams
from backend.types.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(180)

EXAMPLES = Path(__file__).resolve().parents[1] / "protos" / "examples"
PROMPT = [3, 4, 5, 6, 7]

if shutil.which("node") is None or not (EXAMPLES / "node_modules" / "@grpc" / "grpc-js").is_dir():
    pytest.skip("needs node and `npm install` in protos/examples", allow_module_level=True)


@pytest.fixture(scope="module")
def backend(tiny_checkpoint):
    with tiny_llama_backend(tiny_checkpoint("llama"), Limits()) as running:
        yield running


def node(script: str, *args) -> str:
    done = subprocess.run(["node", script, *map(str, args)], cwd=EXAMPLES, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_generate_client_prints_the_engines_greedy_tokens(backend):
    engine, loop, server, _ = backend
    printed = node("generate_client.js", f"127.0.0.1:{server.port}", *PROMPT).splitlines()

    async def in_process():
        params = SamplingParams(temperature=0.0, max_tokens=16)  # what the example sends
        return [o async for o in engine.generate("in-process", PROMPT, params)]

    outputs = loop.run(in_process(), timeout=60)
    tokens = [int(t) for line in printed for t in line.split(":", 1)[1].split("[")[0].split()]
    assert tokens == [t for o in outputs for t in o.new_token_ids]
    assert printed[-1].endswith(f"[FINISH_REASON_{outputs[-1].finish_reason.name.upper()}]")


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embed_client_prints_the_engines_embedding(backend, pooling):
    engine, loop, server, _ = backend
    printed = json.loads(node("embed_client.js", f"127.0.0.1:{server.port}", pooling.upper(), *PROMPT))
    expected = loop.run(engine.embed("in-process", PROMPT, PoolingParams(type=pooling)), timeout=60)
    assert printed["num_prompt_tokens"] == len(PROMPT)
    assert printed["embedding"] == pytest.approx(expected, abs=1e-6) and len(expected) > 1


def test_embed_client_reports_a_refused_request(backend):
    _, _, server, _ = backend
    done = subprocess.run(["node", "embed_client.js", f"127.0.0.1:{server.port}", "LAST", *["1"] * 100],
                          cwd=EXAMPLES, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Embed failed: INVALID_ARGUMENT" in done.stderr
