"""The ``mp`` executor over gloo on the CPU: tensor and pipeline parallel runs give the single
worker's greedy tokens, token for token, for every architecture and the real default model; a
worker's death fails the engine within seconds; nothing is ever left running.

Each worker process costs a torch import and a model load, so CI runs a lean matrix: TP=2 x PP=2
(which shards and stages every layer kind) for every architecture, TP=2 and PP=2 alone for Llama,
SmolLM2 at TP=2 (uneven KV groups) and TP=2 x PP=2. ``TANDEM_TEST_FULL_MATRIX=1`` runs every
size for every architecture and SmolLM2 (about three times as long).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from distributed_helpers import child_pids, is_alive, no_leftover_children, wait_until  # noqa: F401
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import LoopThread
from test_correctness import make_engine, random_prompts, run_engine

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.engine.llm_engine import LLMEngine
from backend.server.grpc_server import BackendServer
from backend.types.config import EngineConfig
from backend.types.errors import EngineDeadError, InvalidRequestError, WorkerDiedError
from backend.types.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("no_leftover_children")]

REPO_ROOT = Path(__file__).resolve().parents[1]
ARCHS = ["llama", "qwen2", "mistral", "opt", "gpt2"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
TINY_PROMPT_LENGTHS = [1, 3, 7, 17, 33, 50]
FULL_MATRIX = os.environ.get("TANDEM_TEST_FULL_MATRIX") == "1"
SIZES = [(2, 1), (1, 2), (2, 2)]
TINY_MATRIX = [(arch, tp, pp) for arch in ARCHS for tp, pp in SIZES
               if FULL_MATRIX or (tp, pp) == (2, 2) or arch == "llama"]
SMOLLM2_SIZES = SIZES if FULL_MATRIX else [(2, 1), (2, 2)]


def run_and_stop(model_dir, prompts, params=GREEDY, **kwargs) -> tuple[list[list[int]], LLMEngine]:
    engine = make_engine(model_dir, **kwargs)
    try:
        return run_engine(engine, prompts, params), engine
    finally:
        engine.shutdown()


def assert_workers_gone(engine: LLMEngine) -> None:
    pids = engine.executor.worker_pids
    wait_until(lambda: not any(is_alive(pid) for pid in pids), 10, f"workers {pids} still alive")


_ONE_WORKER: dict[str, list[list[int]]] = {}


@pytest.mark.parametrize("arch, tp, pp", TINY_MATRIX)
def test_tensor_and_pipeline_parallel_equal_one_worker(tiny_checkpoint, arch, tp, pp):
    """Sharded heads, MLP and vocabulary; layers in stages that pass their activations on
    (TP=2 x PP=2: 4 workers); with chunked prefill (a 32-token budget) and a prefix hit."""
    model_dir = tiny_checkpoint(arch)
    prompts = random_prompts(TINY_PROMPT_LENGTHS, 384)
    prompts += [prompts[-1][:20] + [5, 6, 7]]  # a prefix hit
    if arch not in _ONE_WORKER:
        _ONE_WORKER[arch], _ = run_and_stop(model_dir, prompts, max_num_batched_tokens=32)
    got, engine = run_and_stop(model_dir, prompts, max_num_batched_tokens=32,
                               tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert engine.config.executor_backend == "mp" and len(engine.executor.worker_pids) == tp * pp
    assert got == _ONE_WORKER[arch]
    assert_workers_gone(engine)


@pytest.fixture(scope="module")
def smollm2(default_model_dir):
    """SmolLM2's prompts and its single-worker greedy tokens (fp32), computed once."""
    from frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(default_model_dir))
    texts = ["The capital of France is", "def fibonacci(n):", "请介绍一下你自己",
             "The quick brown fox jumps over the lazy dog. " * 3]
    prompts = [tokenizer.encode(t) for t in texts]
    expected, _ = run_and_stop(default_model_dir, prompts, SamplingParams(temperature=0.0, max_tokens=8),
                               block_size=16, num_kv_blocks=64, max_model_len=512)
    return default_model_dir, prompts, expected


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", SMOLLM2_SIZES)
def test_default_model_split_equals_one_worker(smollm2, tp, pp):
    """SmolLM2 has 9 query heads in 3 KV groups: at TP=2 the ranks hold 1 and 2 groups."""
    model_dir, prompts, expected = smollm2
    got, _ = run_and_stop(model_dir, prompts, SamplingParams(temperature=0.0, max_tokens=8),
                          block_size=16, num_kv_blocks=64, max_model_len=512,
                          tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert got == expected


def test_one_worker_process_equals_in_process_and_its_message_stays_small(tiny_checkpoint):
    """mp at TP=1 (what ``bench/offline_throughput.py --executor mp`` measures): the same tokens
    as uni, also seeded sampling with n=2 and under preemption; each decode step's message is
    the same few dozen bytes per request, however long the context grows."""
    model_dir = tiny_checkpoint("llama")
    prompts = random_prompts([20 + i for i in range(12)], 384, seed=5)
    sampled = SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=11, max_tokens=12)
    small_cache = dict(num_kv_blocks=40, max_model_len=128)
    uni = make_engine(model_dir, **small_cache)
    expected = run_engine(uni, prompts, GREEDY), run_engine(uni, prompts[:3], sampled)
    uni.shutdown()
    engine = make_engine(model_dir, distributed_executor_backend="mp", **small_cache)
    try:
        assert (run_engine(engine, prompts, GREEDY), run_engine(engine, prompts[:3], sampled)) == expected
        assert engine.scheduler.num_preemptions_total > 0

        engine.add_request("long", list(range(1, 101)), SamplingParams(temperature=0.0, max_tokens=27,
                                                                        ignore_eos=True))
        sizes = []
        while engine.has_unfinished_requests():
            engine.step()
            sizes.append(engine.executor.last_message_bytes)
    finally:
        engine.shutdown()
    first, decode = sizes[0], sizes[1:-1]
    assert first > 200  # the 100-token prompt, once
    assert max(decode) < 200 and max(decode) - min(decode) <= 8, decode  # context 101 -> 127
    assert_workers_gone(engine)


def test_speculative_drafts_are_verified_on_every_rank(tiny_checkpoint):
    """n-gram drafts travel in the step delta: TP=2 with drafts gives the plain greedy tokens."""
    model_dir = tiny_checkpoint("llama")
    prompts = [p * 3 for p in random_prompts([5, 9], 384, seed=7)]  # repetitive: drafts exist
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected, _ = run_and_stop(model_dir, prompts, params)
    got, engine = run_and_stop(model_dir, prompts, params, tensor_parallel_size=2,
                               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert got == expected
    assert engine.num_draft_tokens_total > 0 and engine.num_accepted_tokens_total > 0


def test_structured_outputs_constrain_the_sampling_rank(tiny_checkpoint):
    """The step's grammar masks travel in the step delta to the rank that samples: TP=2 gives
    the single worker's constrained tokens (which the random model never produces unmasked)."""
    model_dir = tiny_checkpoint("llama")
    specs = [{"regex": r"[0-9]{3}-[a-z]{2}"}, {"choice": ["Paris", "Lyon", "Nice café"]}]
    prompts = random_prompts([4, 6], 384, seed=9)
    expected, got = [], []
    for tp, out in ((1, expected), (2, got)):
        engine = make_engine(model_dir, tensor_parallel_size=tp, max_model_len=256)
        try:
            for spec in specs:
                out.append(run_engine(engine, prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                                      structured_outputs=spec)))
        finally:
            engine.shutdown()
    assert got == expected
    free = run_and_stop(model_dir, prompts[:1], SamplingParams(temperature=0.0, max_tokens=6))[0][0]
    assert expected[0][0][:6] != free  # the mask did change the tokens


# ---- faults --------------------------------------------------------------------------------------


def tp2_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128,
                        max_model_len=256, tensor_parallel_size=2)


def test_an_engine_that_fails_to_start_stops_its_workers(tiny_checkpoint):
    config = EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4,
                          num_kv_blocks=4, distributed_executor_backend="mp")
    with pytest.raises(InvalidRequestError, match="The KV cache holds 16 tokens"):
        LLMEngine(config)  # the workers were up when the KV-cache check failed
    # no_leftover_children: they are gone


def test_a_worker_killed_mid_generation_fails_the_engine_within_seconds(tiny_checkpoint):
    engine = LLMEngine(tp2_config(tiny_checkpoint("llama")))
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        for _ in range(3):
            engine.step()
        victim = engine.executor.worker_pids[1]
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=rf"Worker rank 1 \(pid {victim}\) was killed by SIGKILL"):
            while time.monotonic() - start < 30:
                engine.step()
        assert time.monotonic() - start < 5
        with pytest.raises(WorkerDiedError):  # and it stays failed
            engine.step()
        assert_workers_gone(engine)  # the survivor is stopped too, not left in a collective
    finally:
        engine.shutdown()


def test_an_idle_worker_death_turns_health_not_serving_and_requests_unavailable(tiny_checkpoint):
    from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

    loop = LoopThread()
    engine = AsyncLLMEngine(tp2_config(tiny_checkpoint("llama")))
    server = BackendServer(engine, "127.0.0.1", 0)
    try:
        loop.run(server.start())
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            request = engine_pb2.GenerateRequest(request_id="a", prompt_token_ids=[1, 2, 3],
                                                 sampling_params=engine_pb2.SamplingParams(max_tokens=3))
            assert len(list(stub.Generate(request, timeout=30))) == 3  # it serves
            serving = health_pb2.HealthCheckResponse.SERVING
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == serving
            pids = engine.engine.executor.worker_pids
            os.kill(pids[0], signal.SIGKILL)  # nothing is running: only the executor's reader sees it
            waited = wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                                != serving, 5, "health still SERVING after a worker died")
            assert waited < 5
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(request, timeout=10))
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "Worker rank 0" in error.value.details() and "SIGKILL" in error.value.details()
            with pytest.raises(EngineDeadError):
                loop.run(engine.generate("b", [1], SamplingParams()).__anext__())
            wait_until(lambda: not any(is_alive(pid) for pid in pids), 10, "workers still alive")
    finally:
        loop.run(server.stop(0))
        engine.shutdown()
        loop.run(asyncio.sleep(0.1))  # let the engine loop's cancelled task finish
        loop.close()


def test_ctrl_c_stops_the_backend_and_every_worker(tiny_checkpoint):
    """Ctrl-C in a terminal signals the whole process group: the workers ignore it, the server
    drains, stops them and exits 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "backend.server", str(tiny_checkpoint("llama")), "--tensor-parallel-size",
         "2", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--dtype", "float32",
         "--num-kv-blocks", "64", "--block-size", "4", "--max-model-len", "256"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        wait_until(lambda: any("Backend serving" in line for line in lines) or proc.poll() is not None,
                   240, "the backend did not start")
        assert proc.poll() is None, "".join(lines)
        workers = child_pids(proc.pid)
        assert len(workers) == 2, workers
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, "".join(lines)
        wait_until(lambda: not any(is_alive(pid) for pid in workers), 5, f"workers {workers} outlived Ctrl-C")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_worker_whose_engine_was_killed_exits_by_itself():
    """SIGKILL gives the engine no chance to stop its workers: each notices its parent is gone
    (even while its socket stays open, as when blocked in a collective) and exits. The worker
    is started bare (never set up: no model), under a stand-in engine process."""
    import socket

    ours, theirs = socket.socketpair()  # we keep our end open: only the watchdog can end it
    stand_in = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, os, time\n"
         "fd = int(sys.argv[1])\n"
         "w = subprocess.Popen([sys.executable, '-m', 'backend.executor.mp_worker', str(fd), "
         "str(os.getpid())], pass_fds=[fd])\n"
         "print(w.pid, flush=True)\n"
         "time.sleep(600)\n", str(theirs.fileno())],
        cwd=REPO_ROOT, pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    theirs.close()
    worker = None
    try:
        worker = int(stand_in.stdout.readline())
        time.sleep(1.0)
        assert is_alive(worker)  # waiting for its set-up message
        stand_in.kill()
        stand_in.wait()
        wait_until(lambda: not is_alive(worker), 5, f"worker {worker} outlived its killed engine")
    finally:
        ours.close()
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait()
        if worker is not None and is_alive(worker):
            os.kill(worker, signal.SIGKILL)
