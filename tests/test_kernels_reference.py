"""kernels.reference against dense, obviously-correct torch: the oracle the Triton kernels will meet."""

from __future__ import annotations

import pytest
import torch

from tandem_kernels import ops as kernels
from kernel_cases import make_paged_batch
from tandem_kernels import reference as R


def dense_causal_attention(q, k, v, scale):
    """q: [q_len, H, d] (the last q_len positions); k, v: [seq_len, KVH, d]. Plain softmax(QK^T)V."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    pos_q = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_paged_attention_mixed_batch_matches_dense(dtype, atol):
    # (tokens already cached, tokens computed this step): decodes, a fresh prompt, a chunk after a prefix
    b = make_paged_batch([(9, 1), (0, 7), (13, 5), (3, 1), (0, 1)], 6, 2, 16, 4, dtype)
    plan = b.plan()
    assert plan.num_decodes == 3 and len(plan.prefills) == 2
    scale = 16 ** -0.5
    out = R.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache, plan, scale)
    assert out.shape == b.query.shape and out.dtype == dtype
    start = 0
    for (k_all, v_all), q_len in zip(b.full_kv, b.query_lens):
        expected = dense_causal_attention(b.query[start:start + q_len], k_all, v_all, scale)
        torch.testing.assert_close(out[start:start + q_len].double(), expected, atol=atol, rtol=atol)
        start += q_len


def test_write_kv_cache_places_each_token_in_its_slot():
    k_cache = torch.zeros(8, 2, 4, 3)  # [num_blocks, kvh, block_size, d]
    assert k_cache.shape == R.kv_cache_shape(8, 4, 2, 3)
    v_cache = torch.zeros_like(k_cache)
    key = torch.arange(5 * 2 * 3, dtype=torch.float32).view(5, 2, 3)
    slots = torch.tensor([0, 5, 6, 31, 12])
    R.write_kv_cache(key, -key, k_cache, v_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        block, row = divmod(slot, 4)
        torch.testing.assert_close(k_cache[block, :, row], key[token])
        torch.testing.assert_close(v_cache[block, :, row], -key[token])
    untouched = torch.ones(8 * 4, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.transpose(1, 2).reshape(-1, 2, 3)[untouched].any()
    assert not v_cache.transpose(1, 2).reshape(-1, 2, 3)[untouched].any()


def test_rms_norm_and_rotary_match_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaRMSNorm, LlamaRotaryEmbedding,
                                                          apply_rotary_pos_emb)

    torch.manual_seed(0)
    x = torch.randn(7, 32)
    hf_norm = LlamaRMSNorm(32, eps=1e-6)
    hf_norm.weight.data.normal_()
    torch.testing.assert_close(R.rms_norm(x, hf_norm.weight, 1e-6), hf_norm(x))
    residual = torch.randn(7, 32)
    normed, summed = R.fused_add_rms_norm(x, residual, hf_norm.weight, 1e-6)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(normed, hf_norm(x + residual))

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf_rope = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 3, 17, 63, 5])
    q = torch.randn(5, 4 * 16)
    k = torch.randn(5, 2 * 16)
    cos, sin = hf_rope(q, positions.unsqueeze(0))
    hf_q, hf_k = apply_rotary_pos_emb(q.view(1, 5, 4, 16).transpose(1, 2), k.view(1, 5, 2, 16).transpose(1, 2), cos, sin)
    cache = R.rotary_cos_sin(hf_rope.inv_freq, 64)
    out_q, out_k = kernels.apply_rotary(positions, q, k, cache, 16)
    torch.testing.assert_close(out_q, hf_q.transpose(1, 2).reshape(5, -1))
    torch.testing.assert_close(out_k, hf_k.transpose(1, 2).reshape(5, -1))
