"""Triton KV-cache write by slot mapping: one program per token copies all its KV heads.

Layout as in kernels/tandem_kernels/reference.py; slot = block_id * block_size + row. The kernels
are stride-driven: ``cache_geometry`` is the one place that reads the layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.launch_config import heads_config


def cache_geometry(cache: torch.Tensor) -> tuple[tuple[int, int, int, int], tuple[int, int, int]]:
    """((num_blocks, block_size, num_kv_heads, head_dim), (block, row, head) strides) of a
    cache laid out as ``tandem_kernels.ops.kv_cache_shape`` says, [num_blocks, num_kv_heads, block_size,
    head_dim] (its head_dim stride must be 1)."""
    if cache.dim() != 4 or cache.stride(-1) != 1:
        raise ValueError(f"a KV cache is 4-D with a contiguous head_dim; got {tuple(cache.shape)}")
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    return (num_blocks, block_size, num_kv_heads, head_dim), (cache.stride(0), cache.stride(2), cache.stride(1))


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, num_kv_heads,
                     stride_cb, stride_cr, stride_ch, BLOCK_SIZE: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cr + heads * stride_ch + dims
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim] (any token/head strides, contiguous
    last dim) -> the caches' slots in slot_mapping [num_tokens] (int32 or int64)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    (_, block_size, cache_heads, cache_dim), strides = cache_geometry(k_cache)
    if value.shape != key.shape or (cache_heads, cache_dim) != (num_kv_heads, head_dim) \
            or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not fit caches "
                         f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value need a contiguous last dim")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{num_tokens}]; got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if num_tokens:
        config = heads_config(num_kv_heads, head_dim)
        _write_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1),
            value.stride(0), value.stride(1), num_kv_heads, *strides, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
            HEADS_PAD=config.heads_pad, DIM_PAD=config.width_pad, num_warps=config.num_warps)
