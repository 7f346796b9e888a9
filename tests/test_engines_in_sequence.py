"""Engines come and go in one process, as notebooks and test suites use them: ``LLM`` objects
with the mp and Ray executors, built and shut down one after another, each give Hugging Face's
greedy tokens, each shuts down promptly, and nothing they started is left running.

Each case runs in a fresh interpreter (engines_in_sequence_child.py), because what matters is
the process's own state: nothing has called ``ray.init()`` before, so Tandem starts Ray itself,
from an engine's thread, which is the path that used to abort the process a minute after
``shutdown()`` ("Failed to connect to GCS") and orphan Ray's workers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from distributed_helpers import is_alive
from test_correctness import hf_greedy, random_prompts

pytest.importorskip("ray", reason="the ray executor's tests need Ray: pip install 'tandem[ray]'")

CHILD = Path(__file__).with_name("engines_in_sequence_child.py")
MAX_TOKENS = 8
SHUTDOWN_BOUND_S = 10.0  # the acceptance bound for one engine's shutdown (Ray included)
SMALL = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)


def run_child(model_dir, prompts, engines: list[dict], timeout: float) -> list[dict]:
    spec = {"model": str(model_dir), "prompts": prompts, "max_tokens": MAX_TOKENS,
            "engines": [dict(SMALL, **e) for e in engines]}
    try:
        done = subprocess.run([sys.executable, str(CHILD), json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout, cwd=CHILD.parents[1])
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the engines did not finish within {timeout} s:\n{(error.stderr or '')[-3000:]}")
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    reports = json.loads(done.stdout.strip().splitlines()[-1])
    # Whatever the child started, none of it outlived the child either.
    started = {pid for report in reports for pid in report["started"]}
    assert not [pid for pid in started if is_alive(pid)]
    return reports


def check(reports: list[dict], expected: list[list[int]]) -> None:
    for report in reports:
        name = report["engine"]
        assert report["tokens"] == expected, f"{name}: not HF's greedy tokens"
        assert report["shutdown_s"] <= SHUTDOWN_BOUND_S, f"{name}: shutdown took {report['shutdown_s']:.1f} s"
        assert report["leftover"] == [], f"{name}: processes left running: {report['leftover']}"


@pytest.mark.timeout(900)
def test_mp_engines_then_ray_engines_in_one_process(tiny_checkpoint):
    """mp at TP=2, PP=2 and TP=2 x PP=2, then Ray at TP=2 twice (Tandem starts Ray, ends it with
    the engine, and starts it afresh for the next), then one in-process (uni) engine."""
    model_dir = tiny_checkpoint("llama")
    prompts = random_prompts([3, 17], 384, seed=7)
    engines = [dict(distributed_executor_backend="mp", tensor_parallel_size=2),
               dict(distributed_executor_backend="mp", pipeline_parallel_size=2),
               dict(distributed_executor_backend="mp", tensor_parallel_size=2, pipeline_parallel_size=2),
               dict(distributed_executor_backend="ray", tensor_parallel_size=2),
               dict(distributed_executor_backend="ray", tensor_parallel_size=2),
               dict(distributed_executor_backend="uni")]
    reports = run_child(model_dir, prompts, engines, timeout=840)
    check(reports, hf_greedy(model_dir, prompts, MAX_TOKENS))
    assert all(report["started"] for report in reports)  # the check saw their processes


@pytest.mark.timeout(400)
def test_a_lone_ray_engine_that_started_ray_shuts_down_promptly(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    prompts = random_prompts([5], 384, seed=8)
    reports = run_child(model_dir, prompts, [dict(distributed_executor_backend="ray", tensor_parallel_size=2)],
                        timeout=360)
    check(reports, hf_greedy(model_dir, prompts, MAX_TOKENS))
