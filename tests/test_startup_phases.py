"""Talkative, fast starts: every start says what it does, one '[start-up] PHASE: WHAT (S.S s)' line per
phase (backend/types/startup_log.py), for offline ``LLM()``, ``tandem serve`` and its backend; and a
CPU start captures no decode graph: each batch size's traced graph is recorded on its first step,
with greedy tokens unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_correctness import GREEDY, make_engine, random_prompts, run_engine

from backend.types.startup_log import PHASE_LINE, parse_phases, seconds_since_process_start
from backend.worker.traced_graph import TracedGraph
from helpers import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINE_PHASES = ["model", "CPU kernels", "weights", "decode graphs", "KV cache"]  # in the order they end
# The CPU kernels are found or built in the background while the model is found: either may end first.
OVERLAPPING = {"model", "CPU kernels"}
START_TIMEOUT_S = 240


def test_phase_lines_read_back():
    log = ("2026-01-01 INFO backend.worker.worker: [start-up] weights: /m on cpu in float32 (9.6 s)\n"
           "noise [start-up] not a phase line\n"
           "[start-up] ready: LLM(x) (26.4 s)\n")
    assert parse_phases(log) == [("weights", "/m on cpu in float32", 9.6), ("ready", "LLM(x)", 26.4)]
    assert PHASE_LINE.search("[start-up] KV cache: 10 blocks of 16 tokens, 0.01 GiB, sized and allocated (0.0 s)")


@pytest.mark.timeout(60)
def test_seconds_since_process_start_counts_the_interpreter_start():
    code = ("import time; time.sleep(1.0)\n"
            "from backend.types.startup_log import seconds_since_process_start as s; print(s())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=50)
    assert 1.0 <= float(out.stdout) < 45, out  # the sleep ran before the module was imported
    assert seconds_since_process_start() > 0


@pytest.mark.timeout(600)
def test_a_cpu_start_captures_no_graph_and_each_batch_size_records_on_its_first_step(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    prompts = random_prompts([3, 11, 6], 384)
    expected = run_engine(make_engine(model_dir, enforce_eager=True), prompts, GREEDY)
    engine = make_engine(model_dir, max_num_seqs=4, max_num_batched_tokens=32)
    graphs = engine.executor.worker.runner.graphs
    assert graphs.graph_cls is TracedGraph and graphs.sizes == [1, 2, 3, 4]
    assert graphs.graphs == {}  # nothing captured at start
    assert run_engine(engine, prompts, GREEDY) == expected  # the recording steps compute for real
    captured = set(graphs.graphs)
    assert 3 in captured and captured <= {1, 2, 3}
    first_replays = {size: graph.num_replays for size, graph in graphs.graphs.items()}
    assert run_engine(engine, prompts, GREEDY) == expected
    assert set(graphs.graphs) == captured  # captured once per size
    assert all(graphs.graphs[size].num_replays > first_replays[size] for size in captured)


def phases_in(text: str) -> list[str]:
    """The phases in the order they ended, the two that overlap in ENGINE_PHASES' order."""
    phases = [phase for phase, _, _ in parse_phases(text)]
    if set(phases[:2]) == OVERLAPPING:
        phases[:2] = ENGINE_PHASES[:2]
    return phases


@pytest.mark.timeout(300)
def test_llm_prints_every_phase_on_stderr_without_any_logging_set_up(tiny_checkpoint):
    code = textwrap.dedent(f"""
        from frontend.entrypoints.llm import LLM
        llm = LLM({str(tiny_checkpoint("llama"))!r}, dtype="float32", num_kv_blocks=64, block_size=4,
                  max_model_len=128)
        llm.shutdown()
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=START_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert phases_in(result.stderr) == [*ENGINE_PHASES, "ready"], result.stderr
    lines = {phase: what for phase, what, _ in parse_phases(result.stderr)}
    assert "CPU traced graphs" in lines["decode graphs"] and "captured when its batch size first runs" in \
        lines["decode graphs"]
    assert "64 blocks of 4 tokens" in lines["KV cache"]
    assert "cuda" not in result.stderr.lower()  # nothing named for a device that is not there


@pytest.mark.timeout(300)
def test_serve_shows_the_backend_phases_and_when_it_was_ready(tiny_checkpoint, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "frontend.entrypoints.cli", "serve", str(tiny_checkpoint("llama")),
               "--port", str(port), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
               "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "128"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TANDEM_CACHE": str(tmp_path / "cache")})
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Tandem is serving" not in log.read_text(errors="replace"):
            assert process.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    text = log.read_text(errors="replace")
    assert phases_in(text) == [*ENGINE_PHASES, "ready"], text
    (ready,) = [what for phase, what, _ in parse_phases(text) if phase == "ready"]
    assert ready.startswith("the backend serves gRPC on 127.0.0.1:")
    assert f"at http://127.0.0.1:{port}/v1 (ready " in text and " s after start)" in text


@pytest.mark.timeout(400)
def test_the_startup_bench_times_warm_starts_and_tabulates_their_phases(tiny_checkpoint):
    """bench/startup.py's smallest run: warm `tandem backend` and LLM() on the tiny model, on this
    HOME's caches (the compiled kernels); every row answered, with its phases read from the logs."""
    command = [sys.executable, "bench/startup.py", "--kinds", "backend,llm", "--starts", "warm",
               "--home", os.path.expanduser("~"), "--model", str(tiny_checkpoint("llama")),
               "--engine-args", "--dtype float32 --num-kv-blocks 64 --max-model-len 128", "--timeout", "180"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=390)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| warm |")]
    assert [row.split(" | ")[1] for row in rows] == ["tandem backend (to ready)", "LLM()"], result.stdout
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[2].endswith(" s") and float(cells[2][:-2]) > 0
        assert all(cell != "-" for cell in cells[4:]), row  # model, kernels, weights, KV cache, graphs, ready
    assert "1-minute load average" in result.stdout
