"""The attention layer every model uses, and the per-step metadata it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

import kernels


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, read by every attention layer.

    Requests are laid out back to back in the flat token batch: request i owns
    rows ``query_start_loc[i]:query_start_loc[i + 1]``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] KV-cache slot of each token
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] tokens in the cache after this step
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    max_query_len: int
    max_seq_len: int
    plan: Optional[kernels.AttentionPlan] = None  # CPU path: index work shared by all layers


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over the cache.

    The model runner binds ``kv_cache`` = (k_cache, v_cache), each
    ``kernels.kv_cache_shape`` (see kernels/reference.py),
    before the first step.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv_heads * head_dim]."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = self.kv_cache
        kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = kernels.paged_attention(q, k, v, k_cache, v_cache, meta.plan, self.scale)
        return out.view(num_tokens, self.num_heads * self.head_dim)
