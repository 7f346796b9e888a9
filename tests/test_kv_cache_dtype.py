"""--kv-cache-dtype fp8: K and V stored as float8 e4m3 (clamped to +-448), read back exactly.

The fused CPU kernels against the reference on fp8 caches, and an engine on an fp8 cache: the
cache's dtype and size, and the same greedy tokens alone and batched, with the fused kernels and
on the plain-torch path (both round as torch's fp8 conversion does).
"""

from __future__ import annotations

import pytest
import torch
from test_correctness import make_engine, random_prompts, run_engine
from test_kernels_cpu import TOL, _batch, reference_and_fused_attention

from tandem_kernels import ops as kernels
import tandem_kernels.cpu as cpu
from backend.models.resolve import resolve_config
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import SamplingParams
from tandem_kernels import reference

FP8 = torch.float8_e4m3fn


def test_unknown_kv_cache_dtypes_are_refused():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of auto, fp8") as info:
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    assert info.value.param == "kv_cache_dtype"


def test_fp8_caches_are_refused_on_cuda(tiny_checkpoint, monkeypatch):
    """The Triton kernels read caches in the model's dtype only: refused before a model loads."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = EngineConfig(model=str(tiny_checkpoint("llama")), device="cuda", kv_cache_dtype="fp8")
    with pytest.raises(InvalidRequestError, match="implemented for the CPU") as info:
        resolve_config(config)
    assert info.value.param == "kv_cache_dtype"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_writes_match_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    key = (torch.randn(6, 2, 16, generator=gen) * 100).to(dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 449.0, 1e-4])  # clamped, clamped, rounded to 448, subnormal
    value = (torch.randn(6, 2, 16, generator=gen) / 50).to(dtype)
    slots = torch.tensor([3, 4, 9, 17, 0, 22])
    caches = [torch.zeros(reference.kv_cache_shape(6, 4, 2, 16), dtype=FP8) for _ in range(4)]
    reference.write_kv_cache(key, value, caches[0], caches[1], slots)
    cpu.write_kv_cache(key, value, caches[2], caches[3], slots)
    for ours, theirs in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    assert caches[0][0, 0, 3, :2].float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64])  # the 8-lane path (a table), the 16-lane ones (bit tricks, bf16 pairs)
@pytest.mark.parametrize("block_size", [8, 5])
def test_paged_attention_on_fp8_caches_matches_reference(dtype, head_dim, block_size):
    query_lens, seq_lens = [1, 1, 7, 5, 1], [9, 17, 7, 21, 33]
    query, k_cache, v_cache, tables = _batch(query_lens, seq_lens, 9, 3, head_dim, block_size, dtype)
    k_cache = reference.to_cache_dtype(k_cache * 40, FP8)  # subnormals to beyond +-448
    v_cache = reference.to_cache_dtype(v_cache, FP8)
    expected, got = reference_and_fused_attention(query, k_cache, v_cache, tables, query_lens, seq_lens,
                                                  block_size, head_dim ** -0.5 / 40)
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])


def test_engine_on_an_fp8_cache(tiny_checkpoint, monkeypatch):
    model_dir = tiny_checkpoint("llama")
    prompts = random_prompts([3, 17, 33, 50], 384)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    engine = make_engine(model_dir, kv_cache_dtype="fp8", num_kv_blocks=None, kv_cache_memory_gb=0.01)
    runner = engine.executor.worker.runner
    assert all(k.dtype == FP8 and v.dtype == FP8 for k, v in runner.kv_caches)
    fp32_engine = make_engine(model_dir, num_kv_blocks=None, kv_cache_memory_gb=0.01)
    assert engine.block_manager.num_blocks >= 3 * fp32_engine.block_manager.num_blocks  # 1 byte, not 4
    batched = run_engine(engine, prompts, greedy)
    assert [run_engine(engine, [p], greedy)[0] for p in prompts] == batched
    eager = run_engine(make_engine(model_dir, kv_cache_dtype="fp8", enforce_eager=True), prompts, greedy)
    assert eager == batched
    monkeypatch.setattr(kernels, "_fused_cpu", [False])  # the plain-torch path (eager: it plans on the host)
    assert run_engine(make_engine(model_dir, kv_cache_dtype="fp8", enforce_eager=True), prompts, greedy) == batched
