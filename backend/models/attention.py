"""The attention layer every model uses, and the per-step metadata it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from tandem_kernels import ops as kernels

if TYPE_CHECKING:
    from backend.models.layers import RotaryEmbedding


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
    """A layer's attention from its fused q | k | v projection, over the paged cache.

    Applies the rotary embedding (if the model has one) to q and k, writes this
    step's K/V into the cache, attends: one ``kernels.qkv_attention`` call, which on
    the CPU is one fused kernel. The model runner binds ``kv_cache`` =
    (k_cache, v_cache), each ``tandem_kernels.ops.kv_cache_shape`` (see
    kernels/tandem_kernels/reference.py), before the first step.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 rotary: Optional["RotaryEmbedding"] = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.rotary = rotary
        self.kv_cache: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, qkv: torch.Tensor, meta: AttentionMetadata,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] (modified in place);
        positions: [num_tokens], needed with a rotary embedding. -> [num_tokens, num_heads * head_dim]."""
        k_cache, v_cache = self.kv_cache
        rotary = self.rotary
        return kernels.qkv_attention(qkv, positions, rotary.cos_sin_cache if rotary else None,
                                 rotary.is_neox if rotary else True, k_cache, v_cache,
                                 meta.slot_mapping, meta.plan, self.num_heads, self.num_kv_heads,
                                 self.head_dim, self.scale)
