"""Triton rotary embedding, applied to Q and K in place: one program per token.

Each program reads its position's cos/sin row once and turns every head of q
and k. NeoX style pairs dim i with i + rotary_dim / 2, GPT-J style 2i with
2i + 1; dims past rotary_dim are left alone (partial rotary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.launch_config import heads_config


@triton.jit
def _rotate_heads(x_ptr, num_heads, head_dim, cos, sin, pairs, pair_ok,
                  HEADS_PAD: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    base = x_ptr + heads[:, None] * head_dim
    if NEOX:
        first = pairs
        second = pairs + HALF
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    mask = (heads[:, None] < num_heads) & pair_ok[None, :]
    x1 = tl.load(base + first[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + second[None, :], mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(base + first[None, :], (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(base + second[None, :], (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, positions_ptr, cos_sin_ptr, stride_q, stride_k, stride_cache,
                   num_q_heads, num_k_heads, head_dim,
                   Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr, NEOX: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    pairs = tl.arange(0, HALF_PAD)
    pair_ok = pairs < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cache + pairs, mask=pair_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF + pairs, mask=pair_ok, other=0.0)
    _rotate_heads(q_ptr + token * stride_q, num_q_heads, head_dim, cos, sin, pairs, pair_ok,
                  Q_HEADS_PAD, HALF, NEOX)
    _rotate_heads(k_ptr + token * stride_k, num_k_heads, head_dim, cos, sin, pairs, pair_ok,
                  K_HEADS_PAD, HALF, NEOX)


def apply_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_dim: int, is_neox: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``tandem_kernels.reference.apply_rotary``, but rotates query and key
    in place (any row stride, e.g. views into a fused QKV output) and returns them.

    positions: [num_tokens]; query: [num_tokens, num_heads * head_dim];
    key: [num_tokens, num_kv_heads * head_dim]; cos_sin_cache: [max_pos, rotary_dim] fp32.
    """
    num_tokens = positions.shape[0]
    rotary_dim = cos_sin_cache.shape[1]
    for name, t in (("query", query), ("key", key)):
        if t.dim() != 2 or t.shape[0] != num_tokens or t.shape[1] % head_dim or t.stride(1) != 1:
            raise ValueError(f"{name} must be [{num_tokens}, heads * {head_dim}] with a contiguous "
                             f"last dim; got {tuple(t.shape)}")
    if rotary_dim > head_dim or rotary_dim % 2 or cos_sin_cache.dtype != torch.float32 \
            or not cos_sin_cache.is_contiguous():
        raise ValueError(f"cos_sin_cache must be a contiguous fp32 [max_pos, rotary_dim <= {head_dim}]")
    if num_tokens:
        num_q_heads, num_k_heads = query.shape[1] // head_dim, key.shape[1] // head_dim
        half = rotary_dim // 2
        q_config, k_config = heads_config(num_q_heads, half), heads_config(num_k_heads, half)
        _rotary_kernel[(num_tokens,)](
            query, key, positions, cos_sin_cache, query.stride(0), key.stride(0), cos_sin_cache.stride(0),
            num_q_heads, num_k_heads, head_dim, Q_HEADS_PAD=q_config.heads_pad, K_HEADS_PAD=k_config.heads_pad,
            HALF=half, HALF_PAD=q_config.width_pad, NEOX=is_neox, num_warps=q_config.num_warps)
    return query, key
