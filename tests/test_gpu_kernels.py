"""The Triton kernels on a CUDA device at realistic shapes (skipped without one).

CPU twin: tests/test_kernels_triton.py (the same kernels under the interpreter, small shapes).
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import make_paged_batch
from tandem_kernels import reference as R

pytestmark = pytest.mark.gpu

# (name, heads, kv heads, head_dim): SmolLM2-135M, Llama-3.2-1B, Qwen2.5-0.5B
SHAPES = [("smollm2", 9, 3, 64), ("llama-1b", 32, 8, 64), ("qwen-0.5b", 14, 2, 64)]


@pytest.mark.parametrize("name, heads, kv_heads, head_dim", SHAPES)
@pytest.mark.parametrize("shapes", [
    [(1023, 1)] * 64,  # decode, one wave
    [(8191, 1)],  # decode, long context: split KV
    [(0, 512), (300, 200), (4000, 1), (17, 1), (2047, 1), (0, 1000)],  # mixed prefill chunks + decodes
], ids=["decode-64x1k", "decode-1x8k", "mixed"])
def test_attention_realistic(name, heads, kv_heads, head_dim, shapes):
    from tandem_kernels import attention

    b = make_paged_batch(shapes, heads, kv_heads, head_dim, 16, torch.bfloat16, "cuda")
    scale = head_dim ** -0.5
    got = attention.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache, b.varlen_plan(), scale)
    want = R.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache, b.plan(), scale)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("hidden", [576, 2048, 896])
def test_norms_and_rotary_realistic(hidden):
    from tandem_kernels import norms, rotary

    g = torch.Generator(device="cuda").manual_seed(0)
    x, residual, weight = (torch.randn(shape, generator=g, device="cuda").bfloat16()
                           for shape in ((2048, hidden), (2048, hidden), (hidden,)))
    normed, summed = norms.fused_add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_summed = R.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed, want_normed, atol=2e-2, rtol=2e-2)

    heads, kv_heads, d = hidden // 64, 2, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    cache = R.rotary_cos_sin(inv_freq.cpu(), 8192).cuda()
    positions = torch.randint(0, 8192, (2048,), device="cuda", generator=g)
    qkv = torch.randn(2048, (heads + 2 * kv_heads) * d, device="cuda", generator=g).bfloat16()
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    want_q, want_k = R.apply_rotary(positions, q, k, cache, d)
    rotary.apply_rotary(positions, q, k, cache, d)
    torch.testing.assert_close(q, want_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k, want_k, atol=2e-2, rtol=2e-2)
