"""kernels.reference against dense, obviously-correct torch: the oracle the Triton kernels will meet."""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels import reference as R


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
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 6, 2, 16, 4, 64
    # (tokens already cached, tokens computed this step): decodes, a fresh prompt, a chunk after a prefix
    shapes = [(9, 1), (0, 7), (13, 5), (3, 1), (0, 1)]
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks).tolist()
    queries, keys, values, slots, tables, seq_lens, query_lens, full_kv = [], [], [], [], [], [], [], []
    for cached, new in shapes:
        seq_len = cached + new
        table = [free.pop() for _ in range(math.ceil(seq_len / block_size))]
        k_all = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype)
        v_all = torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype)
        slot_of = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        # Earlier steps wrote the cached part; this step writes the new part itself.
        R.write_kv_cache(k_all[:cached], v_all[:cached], k_cache, v_cache, torch.tensor(slot_of[:cached], dtype=torch.long))
        queries.append(torch.randn(new, num_heads, head_dim, dtype=dtype))
        keys.append(k_all[cached:])
        values.append(v_all[cached:])
        slots += slot_of[cached:]
        tables.append(table)
        seq_lens.append(seq_len)
        query_lens.append(new)
        full_kv.append((k_all, v_all))
    q, k, v = torch.cat(queries), torch.cat(keys), torch.cat(values)
    R.write_kv_cache(k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.long))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    plan = R.plan_attention(block_tables, seq_lens, query_lens, block_size)
    assert plan.num_decodes == 3 and len(plan.prefills) == 2
    scale = head_dim ** -0.5
    out = R.paged_attention(q, k, v, k_cache, v_cache, plan, scale)
    assert out.shape == q.shape and out.dtype == dtype
    start = 0
    for (k_all, v_all), q_i in zip(full_kv, queries):
        expected = dense_causal_attention(q_i, k_all, v_all, scale)
        torch.testing.assert_close(out[start:start + len(q_i)].double(), expected, atol=atol, rtol=atol)
        start += len(q_i)


def test_write_kv_cache_places_each_token_in_its_slot():
    k_cache = torch.zeros(8, 4, 2, 3)  # [num_blocks, block_size, kvh, d]
    v_cache = torch.zeros_like(k_cache)
    key = torch.arange(5 * 2 * 3, dtype=torch.float32).view(5, 2, 3)
    slots = torch.tensor([0, 5, 6, 31, 12])
    R.write_kv_cache(key, -key, k_cache, v_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        block, row = divmod(slot, 4)
        torch.testing.assert_close(k_cache[block, row], key[token])
        torch.testing.assert_close(v_cache[block, row], -key[token])
    untouched = torch.ones(8 * 4, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(-1, 2, 3)[untouched].any()
    assert not v_cache.view(-1, 2, 3)[untouched].any()


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
