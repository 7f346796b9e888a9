"""The API port's /metrics: the engine families also under vLLM's names (frontend/vllm_metrics.py), and
the queue, prefill, inference and per-step token families (backend/server/metrics.py)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from helpers import LoopThread, backend_and_frontend
from prometheus_client.parser import text_string_to_metric_families

from backend.core.iteration_stats import TokenHistogram
from frontend.vllm_metrics import VLLM_FAMILIES, vllm_named

ENGINE_TEXT = """# HELP tandem:num_requests_running Running.
# TYPE tandem:num_requests_running gauge
tandem:num_requests_running{model_name="m",backend="a:1"} 3.0
# HELP tandem:generation_tokens_total Tokens generated.
# TYPE tandem:generation_tokens_total counter
tandem:generation_tokens_total{model_name="m",backend="a:1"} 12.0
# HELP tandem:engine_errors_total Engine steps that failed.
# TYPE tandem:engine_errors_total counter
tandem:engine_errors_total{model_name="m"} 0.0
"""


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_families_vllm_has_are_renamed_with_their_samples_and_labels():
    renamed = samples(vllm_named(ENGINE_TEXT))
    labels = (("backend", "a:1"), ("model_name", "m"))
    assert renamed == {("vllm:num_requests_running", labels): 3.0, ("vllm:generation_tokens_total", labels): 12.0}
    assert "# TYPE vllm:generation_tokens_total counter" in vllm_named(ENGINE_TEXT)
    assert vllm_named("") == "" and "engine_errors" not in VLLM_FAMILIES


def test_the_step_histogram_is_cumulative_with_an_inf_bucket():
    histogram = TokenHistogram((1, 8))
    for value in (1, 5, 8, 9, 100):
        histogram.observe(value)
    assert histogram.cumulative() == ([("1.0", 1), ("8.0", 3), ("+Inf", 5)], 123)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    from backend.engine.async_llm_engine import AsyncLLMEngine
    from backend.types.config import EngineConfig

    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4,
                                         num_kv_blocks=64, max_model_len=128))
    loop = LoopThread()
    try:
        with backend_and_frontend(loop, engine) as (_server, _address, base_url):
            yield engine, base_url
    finally:
        engine.shutdown()
        loop.close()


def http(base_url: str, path: str, body=None) -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base_url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read().decode()


def test_the_api_ports_metrics_serve_vllms_names_beside_tandems(stack):
    engine, base_url = stack
    model = engine.engine.model_info().model_name
    before = samples(http(base_url, "/metrics"))
    reply = json.loads(http(base_url, "/v1/completions", {"prompt": "Hello there", "max_tokens": 4,
                                                          "temperature": 0, "ignore_eos": True}))
    assert reply["usage"]["completion_tokens"] == 4
    after = samples(http(base_url, "/metrics"))

    def value(name: str, **labels) -> float:
        key = (name, tuple(sorted({"model_name": model, **labels}.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    prompt_tokens = reply["usage"]["prompt_tokens"]
    for prefix in ("tandem:", "vllm:"):
        assert value(prefix + "generation_tokens_total") == 4
        assert value(prefix + "prompt_tokens_total") == prompt_tokens  # a fresh engine: nothing cached
        assert value(prefix + "request_success_total", finished_reason="length") == 1
        for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                          "request_queue_time_seconds", "request_prefill_time_seconds",
                          "request_inference_time_seconds", "request_decode_time_seconds"):
            assert value(prefix + histogram + "_count") == 1, histogram
        # vLLM's count: the prompt and the first token in one step, then 3 steps of one token each.
        assert value(prefix + "iteration_tokens_total_count") == 4
        assert value(prefix + "iteration_tokens_total_sum") == prompt_tokens + 4
        assert value(prefix + "iteration_tokens_total_bucket", le="1.0") == 3
        assert after[(prefix + "num_requests_running", (("model_name", model),))] == 0
        assert (prefix + "kv_cache_usage_perc", (("model_name", model),)) in after
    # The phases add up: queued + inference <= end to end.
    def total(name: str) -> float:
        return value("vllm:" + name + "_sum")

    assert total("request_queue_time_seconds") + total("request_inference_time_seconds") <= \
        total("e2e_request_latency_seconds") + 1e-3
    assert total("request_prefill_time_seconds") <= total("request_inference_time_seconds")
    # Families vLLM has no counterpart for keep their tandem: name only.
    assert ("tandem:engine_errors_total", (("model_name", model),)) in after
    assert not any(name.startswith("vllm:engine_errors") or name.startswith("vllm:http") for name, _ in after)


def test_prompt_tokens_count_whole_prompts_prefix_cache_hits_included(stack):
    """vLLM's prompt_tokens_total counts each sequence's whole prompt; the hits are counted apart."""
    engine, base_url = stack
    model = engine.engine.model_info().model_name
    prefix = [(7 * i + 3) % 200 + 20 for i in range(40)]  # 10 full blocks of 4, shared
    prompts = [prefix + [5, 6, 7], prefix + [8, 9]]
    before = samples(http(base_url, "/metrics"))
    for prompt in prompts:  # one after the other: the second finds the first's blocks cached
        reply = json.loads(http(base_url, "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                                              "temperature": 0, "ignore_eos": True}))
        assert reply["usage"]["prompt_tokens"] == len(prompt)
    after = samples(http(base_url, "/metrics"))

    def value(name: str) -> float:
        key = (name, (("model_name", model),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    for name in ("tandem:", "vllm:"):
        assert value(name + "prefix_cache_hits_total") >= len(prefix)  # the second prompt hit the cache
        assert value(name + "prompt_tokens_total") == sum(map(len, prompts))  # the hits included
        assert value(name + "prefix_cache_queries_total") == sum(map(len, prompts))


def test_speculative_decoding_counters_appear_only_with_a_proposer():
    from types import SimpleNamespace

    from backend.server.metrics import _EngineCollector
    from backend.types.outputs import EngineLoad

    engine = SimpleNamespace(
        get_load=lambda: EngineLoad(num_requests_running=1, num_requests_waiting=0, kv_cache_usage=0.5),
        num_prompt_tokens_total=10, num_prompt_tokens_computed_total=7, num_generation_tokens_total=20,
        num_draft_tokens_total=8,
        num_accepted_tokens_total=5, proposer=None,
        scheduler=SimpleNamespace(num_preemptions_total=0), iteration_tokens=TokenHistogram(),
        config=SimpleNamespace(block_size=4, enable_prefix_caching=True, kv_cache_dtype_name="float32"),
        block_manager=SimpleNamespace(num_blocks=64))
    collector = _EngineCollector(engine, "m")
    assert not any(f.name.startswith("tandem:spec_decode") for f in collector.collect())
    engine.proposer = object()
    values = {s.name: s.value for f in collector.collect() for s in f.samples}
    assert values["tandem:spec_decode_num_draft_tokens_total"] == 8
    assert values["tandem:spec_decode_num_accepted_tokens_total"] == 5
    assert "spec_decode_num_accepted_tokens" in VLLM_FAMILIES


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_tokens_count_as_vllm_counts_them_with_chunks_and_n(tiny_checkpoint, async_scheduling):
    """Per step: tokens generated + the whole prompt of each sequence given its first token;
    a step of prompt chunks alone is not observed (vLLM observes only steps with outputs)."""
    from backend.engine.llm_engine import LLMEngine
    from backend.types.config import EngineConfig
    from backend.types.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4,
                                    num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=16,
                                    async_scheduling=async_scheduling))
    try:
        # 20 prompt tokens over a 16-token budget: the first step computes a chunk and generates
        # nothing. n=2: each sequence counts its whole prompt, as vLLM's child requests do.
        engine.add_request("a", list(range(3, 23)), SamplingParams(n=2, temperature=1.0, seed=1,
                                                                   max_tokens=3, ignore_eos=True))
        steps_with_tokens, first_token_steps, started = 0, 0, set()
        while engine.has_unfinished_requests():
            outputs = [output for output in engine.step() if output.new_token_ids]
            steps_with_tokens += bool(outputs)
            first_token_steps += any(output.index not in started for output in outputs)
            started.update(output.index for output in outputs)
        buckets, total = engine.iteration_tokens.cumulative()
        assert total == 2 * (20 + 3)
        assert buckets[-1] == ("+Inf", steps_with_tokens)
        # Only the steps that give a sequence its first token carry a (20-token) prompt.
        assert dict(buckets)["16.0"] == steps_with_tokens - first_token_steps
    finally:
        engine.shutdown()
