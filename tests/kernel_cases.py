"""Random paged-attention batches shared by the kernel tests and bench/gpu_check.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem_kernels import reference as R


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: this step's, already in the caches
    value: torch.Tensor
    k_cache: torch.Tensor  # kv_cache_shape: [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64
    seq_lens: list[int]
    query_lens: list[int]
    full_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per request: all its K, V [seq_len, kvh, d]

    def plan(self) -> R.AttentionPlan:
        return R.plan_attention(self.block_tables, self.seq_lens, self.query_lens, self.k_cache.shape[2])

    def varlen_plan(self, **overrides) -> R.VarlenPlan:
        plan = R.plan_varlen(self.block_tables, self.seq_lens, self.query_lens)
        for name, value in overrides.items():
            setattr(plan, name, value)
        return plan


def make_paged_batch(shapes, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
                     device="cpu", seed=0, spare_blocks=4) -> PagedBatch:
    """shapes: per request (tokens already cached, tokens computed this step). Blocks are
    handed out in random order, so tables are scattered; the cached part is written
    as earlier steps would have, and this step's K/V too (kernels expect that)."""
    g = torch.Generator().manual_seed(seed)
    need = sum(math.ceil((c + n) / block_size) for c, n in shapes) + spare_blocks
    k_cache = torch.zeros(R.kv_cache_shape(need, block_size, num_kv_heads, head_dim), dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(need, generator=g).tolist()
    queries, keys, values, slots, tables, full_kv = [], [], [], [], [], []
    for cached, new in shapes:
        seq_len = cached + new
        table = [free.pop() for _ in range(math.ceil(seq_len / block_size))]
        k_all = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v_all = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        slot_of = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        R.write_kv_cache(k_all, v_all, k_cache, v_cache, slot_of)
        queries.append(torch.randn(new, num_heads, head_dim, generator=g).to(dtype))
        keys.append(k_all[cached:])
        values.append(v_all[cached:])
        slots.append(slot_of[cached:])
        tables.append(table)
        full_kv.append((k_all.to(device), v_all.to(device)))
    width = max(len(t) for t in tables)
    # Padding entries point at a real block: kernels must never read past seq_len.
    block_tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    return PagedBatch(torch.cat(queries).to(device), torch.cat(keys).to(device), torch.cat(values).to(device),
                      k_cache.to(device), v_cache.to(device), torch.cat(slots).to(device),
                      block_tables.to(device), [c + n for c, n in shapes], [n for _, n in shapes], full_kv)
