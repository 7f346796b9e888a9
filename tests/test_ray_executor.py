"""The ``ray`` executor on a two-node Ray cluster simulated on this machine (Ray's own
``cluster_utils.Cluster``: two raylets, one CPU each), so TP=2 must put one worker on each node.
One cluster serves the whole module (Ray starts slowly); it is stopped, with every process it
started, at the end. The executor is the same for every architecture (their sharding is
tested with ``mp``), so CI runs Llama here; ``TANDEM_TEST_FULL_MATRIX=1`` adds the other
architectures and SmolLM2."""

from __future__ import annotations

import os
import signal
import time

import pytest
from distributed_helpers import child_pids, wait_until
from test_correctness import make_engine, random_prompts, run_engine

from backend.types.errors import WorkerDiedError
from backend.types.sampling_params import SamplingParams

# Ray is in tandem[test] (so CI runs these); a checkout installed without it skips them, saying why.
ray = pytest.importorskip("ray", reason="the ray executor's tests need Ray: pip install 'tandem[ray]'")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.timeout(600)

FULL_MATRIX = os.environ.get("TANDEM_TEST_FULL_MATRIX") == "1"
ARCHS = ["llama", "qwen2", "mistral", "opt", "gpt2"] if FULL_MATRIX else ["llama"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def start_two_nodes(before: set[int], attempts: int = 3) -> Cluster:
    """A head and a second node. Ray waits a fixed 30 s for a raylet to register, which a busy
    2-core machine can miss: a start that fails is torn down (every process it spawned killed)
    and tried again."""
    for attempt in range(1, attempts + 1):
        try:
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
            cluster.add_node(num_cpus=1)
            return cluster
        except Exception:
            if attempt == attempts:
                raise
            for pid in child_pids() - before:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)  # reap it: a zombie still counts as a child
                except (ProcessLookupError, ChildProcessError):
                    pass
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def two_nodes():
    before = child_pids()
    cluster = start_two_nodes(before)
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        cluster.wait_for_nodes()
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        wait_until(lambda: child_pids() <= before, 30, "Ray processes left after the cluster stopped")


def ray_engine(model_dir, **kwargs):
    engine = make_engine(model_dir, tensor_parallel_size=2, **kwargs)
    assert engine.config.executor_backend == "ray"  # chosen because this process joined Ray
    return engine


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_across_two_nodes_equals_one_worker(two_nodes, tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch)
    prompts = random_prompts([1, 4, 17, 40], 384, seed=2)
    one = make_engine(model_dir)
    expected = run_engine(one, prompts, GREEDY)
    one.shutdown()
    engine = ray_engine(model_dir)
    try:
        assert len(set(engine.executor.node_ids)) == 2  # a worker on each node
        assert run_engine(engine, prompts, GREEDY) == expected
    finally:
        engine.shutdown()
    assert ray.is_initialized()  # this process's own connection: Tandem leaves it up


def test_a_cluster_named_by_ray_address_outlives_its_engine(two_nodes, tiny_checkpoint, monkeypatch):
    """Tandem connects through RAY_ADDRESS (from a thread of its own) and disconnects with its
    last engine; the cluster, which it did not start, stays up."""
    model_dir = tiny_checkpoint("llama")
    ray.shutdown()  # this process leaves the cluster, so the engine connects by itself
    monkeypatch.setenv("RAY_ADDRESS", two_nodes.address)
    try:
        engine = make_engine(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
        try:
            assert ray.is_initialized() and len(set(engine.executor.node_ids)) == 2
            assert run_engine(engine, [[1, 2, 3]], GREEDY)[0]
        finally:
            engine.shutdown()
        assert not ray.is_initialized()  # Tandem's connection ended with its engine ...
        # ... and the cluster did not: its GCS and the head's raylet run on. (Ray's helper processes,
        # its dashboard agent among them, may exit on their own on a loaded machine: not counted.)
        dead = {kind for kind, _ in two_nodes.head_node.dead_processes()}
        assert not dead & {"gcs_server", "raylet"}, dead
    finally:
        ray.init(address=two_nodes.address, include_dashboard=False, log_to_driver=False)
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2


@pytest.mark.slow
@pytest.mark.skipif(not FULL_MATRIX, reason="the full matrix only (TANDEM_TEST_FULL_MATRIX=1): "
                    "the executor is model-independent and SmolLM2's split is tested with mp")
def test_default_model_tp2_across_two_nodes_equals_one_worker(two_nodes, default_model_dir):
    from frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(default_model_dir))
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    kwargs = dict(block_size=16, num_kv_blocks=64, max_model_len=512)
    one = make_engine(default_model_dir, **kwargs)
    expected = run_engine(one, prompts, params)
    one.shutdown()
    engine = ray_engine(default_model_dir, **kwargs)
    try:
        assert len(set(engine.executor.node_ids)) == 2
        assert run_engine(engine, prompts, params) == expected
    finally:
        engine.shutdown()


def test_a_killed_actor_fails_the_engine_within_seconds(two_nodes, tiny_checkpoint):
    engine = ray_engine(tiny_checkpoint("llama"))
    try:
        failures = []
        engine.executor.add_failure_callback(failures.append)
        ray.kill(engine.executor.actors[1])  # between steps: only the monitor can notice
        start = time.monotonic()
        wait_until(lambda: failures, 10, "the executor did not notice the dead actor")
        assert time.monotonic() - start < 10
        assert "Ray worker rank 1" in str(failures[0])
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
        with pytest.raises(WorkerDiedError, match="Ray worker rank 1"):
            engine.step()
    finally:
        engine.shutdown()
