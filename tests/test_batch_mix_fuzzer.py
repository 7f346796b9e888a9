"""The batch-mix fuzzer: generated batches that mix every request feature in one engine.

Each engine configuration below gets its share of generated batches (``tests/batch_mix.py`` draws
them and checks the invariants: the engine never dies, every request ends, no block, matcher or
bookkeeping leaks). In fp32 every deterministic request (greedy, beam search) is also run alone
afterwards and must give the same tokens.

The CI run is short and derandomized (the same batches every run): each configuration's share of
``FUZZ_BATCHES_CI`` batches (more for fp32, whose steps are cheapest and which also compares with
running alone; bf16 and fp16 are slow on CPUs without native support). The long run is random and
behind the ``fuzz`` marker::

    TANDEM_FUZZ_BATCHES=3000 python -m pytest -q -m fuzz tests/test_batch_mix_fuzzer.py
"""

from __future__ import annotations

import json
import os

import pytest
from batch_mix import assert_same_as_alone, request_specs, run_batch
from hypothesis import HealthCheck, given, settings

from backend.engine.llm_engine import LLMEngine
from backend.types.config import EngineConfig

FUZZ_BATCHES_CI = 400
# name -> its share of FUZZ_BATCHES_CI
CI_SHARE = {"fp32-eager-ngram-tight": 80, "fp32-graphs": 40, "fp32-graphs-async-tight": 40,
            "bf16-graphs-ngram": 40, "bf16-eager-no-prefix-cache": 40, "fp16-eager-fp8-kv": 40,
            "bf16-w8a8-graphs-ngram": 30, "bf16-int4-graphs": 40, "bf16-gguf-q4km": 25,
            "bf16-awq-g32": 25}
MAX_MODEL_LEN = 64
EOS = 2  # the tiny tokenizer's <|im_end|>: a random model samples it now and then

# name -> (engine arguments, compare with running alone). Small KV caches force preemption;
# a small token budget forces chunked prefill.
ENGINES = {
    "fp32-eager-ngram-tight": (dict(dtype="float32", enforce_eager=True, num_kv_blocks=40, max_num_seqs=6,
                                    max_num_batched_tokens=24,
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_max": 2}), True),
    "fp32-graphs": (dict(dtype="float32", enforce_eager=False, num_kv_blocks=160, max_num_seqs=8,
                         max_num_batched_tokens=64), True),
    # Async scheduling (each step scheduled while the one before runs), with preemption and chunks.
    "fp32-graphs-async-tight": (dict(dtype="float32", enforce_eager=False, async_scheduling=True, num_kv_blocks=40,
                                     max_num_seqs=6, max_num_batched_tokens=24), True),
    "bf16-graphs-ngram": (dict(dtype="bfloat16", enforce_eager=False, num_kv_blocks=48, max_num_seqs=8,
                               max_num_batched_tokens=32,
                               speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                   "prompt_lookup_max": 3}), False),
    "bf16-eager-no-prefix-cache": (dict(dtype="bfloat16", enforce_eager=True, num_kv_blocks=64, max_num_seqs=4,
                                        max_num_batched_tokens=40, enable_prefix_caching=False), False),
    "fp16-eager-fp8-kv": (dict(dtype="float16", enforce_eager=True, kv_cache_dtype="fp8", num_kv_blocks=64,
                               max_num_seqs=6, max_num_batched_tokens=32), False),
    # int8 weights with bf16 activations and KV cache; its linears sum alike whatever the batch.
    "bf16-w8a8-graphs-ngram": (dict(dtype="bfloat16", quantization="w8a8", enforce_eager=False, num_kv_blocks=48,
                                    max_num_seqs=8, max_num_batched_tokens=32,
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                        "prompt_lookup_max": 3}), True),
    # int4 weights: the kernel's sums do not depend on the batch, so neither do the results.
    "bf16-int4-graphs": (dict(dtype="bfloat16", quantization="int4", enforce_eager=False, num_kv_blocks=48,
                              max_num_seqs=8, max_num_batched_tokens=32), True),
    # A Q4_K_M-like GGUF file (Q4_K, Q6_K) served packed: batch-invariant kernels, like int4's.
    "bf16-gguf-q4km": (dict(dtype="bfloat16", quantization="gguf", enforce_eager=True, num_kv_blocks=48,
                            max_num_seqs=8, max_num_batched_tokens=32), True),
    # The checkpoint's linears as AWQ 4-bit (32-wide groups, zero points): repacked for the int4f kernel.
    "bf16-awq-g32": (dict(dtype="bfloat16", enforce_eager=True, num_kv_blocks=48, max_num_seqs=8,
                          max_num_batched_tokens=32), True),
}
# Engines whose outputs also go through a served stream's regrouping (--stream-interval), checked
# to carry every token in order (n-gram drafts make deltas of several tokens).
STREAM_INTERVALS = {"fp32-eager-ngram-tight": 3, "bf16-graphs-ngram": 4, "fp32-graphs-async-tight": 2}
GGUF_ENGINES = {"bf16-gguf-q4km"}  # run the tiny GGUF file (fuzz_gguf) instead of the checkpoint
AWQ_ENGINES = {"bf16-awq-g32"}  # run fuzz_awq, the checkpoint quantized (quantization from its config.json)


@pytest.fixture(scope="module")
def fuzz_checkpoint(tmp_path_factory):
    """The tiny random Llama, with an EOS token (so EOS, min_tokens and ignore_eos all matter)."""
    from conftest import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-fuzz"), "llama", seed=1)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = EOS
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def fuzz_gguf(tmp_path_factory):
    """A tiny Llama GGUF typed as llama.cpp's Q4_K_M mostly is: Q6_K for attn_v, ffn_down and the
    LM head, Q4_K elsewhere; EOS is its <|im_end|>, as the checkpoint's."""
    from test_gguf_blocks import write_mixed_gguf

    def q4km(name):
        if "norm" in name or name == "token_embd.weight":
            return None
        return "Q6_K" if name.split(".")[-2] in ("attn_v", "ffn_down", "output") else "Q4_K"

    return write_mixed_gguf(tmp_path_factory.mktemp("fuzz-gguf") / "tiny-q4km.gguf", q4km)


@pytest.fixture(scope="module")
def fuzz_awq(fuzz_checkpoint, tmp_path_factory):
    """fuzz_checkpoint with its linears quantized to AWQ (GEMM, 4 bits, 32-wide groups)."""
    from int4_checkpoint_writer import write_int4_checkpoint

    out = tmp_path_factory.mktemp("fuzz-awq")
    write_int4_checkpoint(fuzz_checkpoint, out, "awq", 32)
    return out


def checkpoint_for(request, name: str, fuzz_checkpoint):
    """The model engine ``name`` runs: the tiny GGUF file, the AWQ checkpoint or the plain one."""
    if name in GGUF_ENGINES:
        return request.getfixturevalue("fuzz_gguf")
    if name in AWQ_ENGINES:
        return request.getfixturevalue("fuzz_awq")
    return fuzz_checkpoint


def fuzz_engine(checkpoint, name: str) -> LLMEngine:
    arguments, _ = ENGINES[name]
    if name in GGUF_ENGINES:  # the file's conversion cached beside it
        arguments = dict(arguments, download_dir=str(checkpoint.parent / "cache"))
    engine = LLMEngine(EngineConfig(model=str(checkpoint), block_size=4, max_model_len=MAX_MODEL_LEN, seed=0,
                                    **arguments))
    if engine.async_scheduling:  # greedy decode steps left pending on the device, as on CUDA
        engine.executor.defer_steps = True
    return engine


def fuzz(engine: LLMEngine, compare_alone: bool, batches: int, derandomize: bool, stream_interval: int = 1) -> dict:
    stats = {"batches": 0, "requests": 0, "compared": 0}

    @settings(max_examples=batches, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(request_specs(engine.vocab_size, MAX_MODEL_LEN))
    def one_batch(specs):
        outcomes = run_batch(engine, specs, stream_interval=stream_interval)
        stats["batches"] += 1
        stats["requests"] += len(outcomes)
        if compare_alone:
            stats["compared"] += assert_same_as_alone(engine, outcomes)

    one_batch()
    return stats


def test_the_ci_shares_cover_every_engine_and_add_up():
    assert CI_SHARE.keys() == ENGINES.keys() and sum(CI_SHARE.values()) == FUZZ_BATCHES_CI


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(ENGINES))
def test_batch_mix_fuzzer(request, fuzz_checkpoint, name):
    engine = fuzz_engine(checkpoint_for(request, name, fuzz_checkpoint), name)
    try:
        stats = fuzz(engine, ENGINES[name][1], CI_SHARE[name], derandomize=True,
                     stream_interval=STREAM_INTERVALS.get(name, 1))
    finally:
        engine.shutdown()
    assert stats["batches"] == CI_SHARE[name]
    print(f"{name}: {stats}")


@pytest.mark.fuzz
@pytest.mark.timeout(6 * 3600)
@pytest.mark.parametrize("name", sorted(ENGINES))
def test_batch_mix_fuzzer_long(request, fuzz_checkpoint, name):
    """The long, random run: TANDEM_FUZZ_BATCHES batches in all (default 3,000)."""
    batches = int(os.environ.get("TANDEM_FUZZ_BATCHES", "3000")) // len(ENGINES)
    engine = fuzz_engine(checkpoint_for(request, name, fuzz_checkpoint), name)
    try:
        stats = fuzz(engine, ENGINES[name][1], batches, derandomize=False,
                     stream_interval=STREAM_INTERVALS.get(name, 1))
    finally:
        engine.shutdown()
    print(f"{name}: {stats}")
