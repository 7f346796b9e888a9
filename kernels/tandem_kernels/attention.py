"""Triton paged attention: one varlen kernel for prefill chunks and decodes, plus a split-KV merge.

Request i owns query rows ``query_start_loc[i]:query_start_loc[i + 1]`` (its newest
``q_len`` tokens, at positions ``seq_len - q_len ...``) and attends causally to the
first ``seq_len`` tokens of its paged KV cache, this step's included (the cache
write runs first). That one rule covers decodes, fresh prompts, chunks after a
prefix hit and chunks after earlier chunks.

One program handles (query tile, KV head, KV split). Its tile packs the
GROUP query heads sharing the KV head (GQA) with BLOCK_Q query tokens, so each K/V
tile is read once for all of them::

    tile row r:  token = tile * BLOCK_Q + r // GROUP,  head = kv_head * GROUP + r % GROUP
    KV token n:  cache slot = block_tables[i, n // block_size] * block_size + n % block_size

It streams K/V in TILE-token tiles gathered through the block table, with an
online softmax (running max and sum, in the exp2 domain). With one split it
writes the normalized output. Decode batches with too few (request, KV head)
programs to fill the GPU split each context into partitions ("flash-decoding"):
every working split writes its unnormalized accumulator, max and sum, and
``_merge_splits_kernel`` combines them.

Both grid axes that depend on lengths are fixed by Python ints alone and the work
is found on the device, so a CUDA graph captured once replays right at any length:

- splits: the grid holds ``launch_config.kv_splits``'s cap; each request picks its
  own split count and partition size from its real seq_len
  (``launch_config.request_partition``) and splits past its context exit at once.
- query tiles: decodes run one program per request; otherwise programs cover the
  real tiles (``launch_config.query_tile_grid``) and each finds its request by a
  binary search over ``query_start_loc``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator, Optional

import torch
import triton
import triton.language as tl

from tandem_kernels.cache_ops import cache_geometry
from tandem_kernels.launch_config import (PARTITION_ALIGN, attention_config, kv_splits, merge_config,
                                          query_tile_grid)
from tandem_kernels.reference import VarlenPlan

# The interpreter's tl.dot mishandles bf16 operands (Triton 3.9: wrong by orders of magnitude;
# fp16 is right); there, and only for bf16, the kernel upcasts them first. bf16 x bf16 products
# are exact in fp32, so this computes what tensor cores do. Compiled, every dot takes the
# operands in the query's dtype (bf16/fp16 tensor cores, fp32 accumulation).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634


@triton.jit
def _request_partition(seq_len, grid_splits, min_partition, ALIGN: tl.constexpr):
    """launch_config.request_partition on the device: (working splits, partition size)."""
    splits = tl.maximum(1, tl.minimum(grid_splits, tl.cdiv(seq_len, min_partition)))
    partition = tl.cdiv(tl.cdiv(tl.maximum(seq_len, 1), splits), ALIGN) * ALIGN
    return tl.cdiv(seq_len, partition), partition


@triton.jit
def _attention_kernel(
        out_ptr, split_acc_ptr, split_max_ptr, split_sum_ptr,
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        scale_log2, num_reqs, search_steps, min_partition, num_heads, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cr, stride_ch, stride_bt,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
        TILE_SEARCH: tl.constexpr, ALIGN: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Which request and query tile (launch_config.query_tile_grid): a decode program is its
    # request's only tile; else request r's tiles start at first_tile(r) and the program's
    # request is the last r with first_tile(r) <= pid (a binary search, search_steps probes).
    req = pid
    tile = 0
    if TILE_SEARCH:
        req = pid * 0
        tile = pid  # pid - first_tile(req); first_tile(0) == 0
        for probe_step in range(search_steps):
            probe = req + (1 << (search_steps - 1 - probe_step))
            ok = probe < num_reqs
            first = (tl.load(query_start_loc_ptr + probe, mask=ok, other=0) + probe * (BLOCK_Q - 1)) // BLOCK_Q
            found = ok & (first <= pid)
            req = tl.where(found, probe, req)
            tile = tl.where(found, pid - first, tile)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    if tile * BLOCK_Q >= q_len:
        return
    context = seq_len - q_len  # tokens cached before this step's queries
    if SPLIT:  # this request's own layout; splits past its context exit at once
        working, partition = _request_partition(seq_len, num_splits, min_partition, ALIGN)
        if split >= working:
            return

    rows = tl.arange(0, BLOCK_M)
    token = tile * BLOCK_Q + rows // GROUP  # [BLOCK_M] query token within the request
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    q_pos = context + token  # [BLOCK_M] position each row sits at (sees keys <= it)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    # This split's KV range, cut at the tile's last (causal) position.
    last_pos = context + tl.minimum(q_len, (tile + 1) * BLOCK_Q) - 1
    kv_begin = 0
    kv_end = tl.minimum(seq_len, last_pos + 1)
    if SPLIT:
        kv_begin = split * partition
        kv_end = tl.minimum(kv_end, kv_begin + partition)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(kv_begin, kv_end, TILE):
        n = start + tl.arange(0, TILE)  # [TILE] KV token index
        n_ok = n < kv_end
        block = tl.load(block_tables_ptr + req * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & dim_ok[None, :]
        offsets = block[:, None] * stride_cb + in_block[:, None] * stride_cr + kv_head * stride_ch + dims[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)  # [TILE, HEAD_DIM_PAD]
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE]
        s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_rows = q_start + token
    if SPLIT:
        # Decode batches only: token row == request, [num_tokens, num_heads, num_splits(, HEAD_DIM)].
        idx = (out_rows * num_heads + head) * num_splits + split  # [BLOCK_M]
        tl.store(split_acc_ptr + idx[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(split_max_ptr + idx, m_i, mask=row_ok)
        tl.store(split_sum_ptr + idx, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + out_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_splits_kernel(out_ptr, split_acc_ptr, split_max_ptr, split_sum_ptr, seq_lens_ptr,
                         min_partition, num_heads, num_splits, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                         ALIGN: tl.constexpr):
    """One program per (decode token, head): out = sum_s w_s acc_s / sum_s w_s l_s, w_s = 2^(m_s - max m)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + token)
    splits = tl.arange(0, SPLITS_PAD)
    working, _ = _request_partition(seq_len, num_splits, min_partition, ALIGN)
    live = splits < working  # the splits that ran (the attention kernel's same rule)
    base = (token * num_heads + head) * num_splits
    m = tl.load(split_max_ptr + base + splits, mask=live, other=float("-inf"))
    m_max = tl.max(m, axis=0)
    w = tl.where(live, tl.exp2(m - m_max), 0.0)  # [SPLITS_PAD]
    total = tl.sum(w * tl.load(split_sum_ptr + base + splits, mask=live, other=0.0), axis=0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(split_acc_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                  mask=live[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


_assumed_sm_count: Optional[int] = None


@contextlib.contextmanager
def assume_sm_count(count: int) -> Iterator[None]:
    """Launch as if the device had ``count`` SMs (tests and the compile probe: off CUDA
    ``_num_sms`` is 0, which never splits)."""
    global _assumed_sm_count
    if count < 0:
        raise ValueError(f"assume_sm_count({count}): must be >= 0")
    previous, _assumed_sm_count = _assumed_sm_count, count
    try:
        yield
    finally:
        _assumed_sm_count = previous


def _num_sms(device: torch.device) -> int:
    if _assumed_sm_count is not None:
        return _assumed_sm_count
    return _device_sm_count(device)


@functools.cache
def _device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_layout(plan: VarlenPlan, num_kv_heads: int, device: torch.device) -> tuple[int, int]:
    """(grid_splits, min_partition) for a plan on this device (``launch_config.kv_splits``):
    the plan's Python ints and the device's SM count alone, so a captured graph and its
    replays agree; each request's working splits follow from its seq_len on the device."""
    return kv_splits(plan.seq_lens.shape[0], num_kv_heads, plan.max_query_len, plan.max_seq_len,
                     _num_sms(device), plan.num_splits)


def _split_workspace(num_tokens: int, num_heads: int, num_splits: int, head_dim: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (token, head, split): the unnormalized accumulator, running max and sum (fp32).
    Only working splits write theirs; the merge reads only those."""
    acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    row_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device)
    return acc, row_max, torch.empty_like(row_max)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, plan: VarlenPlan,
                    scale: float) -> torch.Tensor:
    """Same contract as ``tandem_kernels.reference.paged_attention`` (``key``/``value`` are
    read back from the caches, where this step's were written).

    query: [num_tokens, num_heads, head_dim], last dim contiguous;
    k_cache, v_cache: the caches (kernels/tandem_kernels/reference.py's layout), query's dtype, equal strides. Returns [num_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    (_, block_size, num_kv_heads, cache_dim), cache_strides = cache_geometry(k_cache)
    if cache_dim != head_dim or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit "
                         f"query {tuple(query.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if not (k_cache.dtype == v_cache.dtype == query.dtype):
        raise ValueError(f"dtypes differ: query {query.dtype}, caches {k_cache.dtype}/{v_cache.dtype}")
    if query.stride(-1) != 1:
        raise ValueError("query's last dim must be contiguous")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        t = getattr(plan, name)
        if t.dtype != torch.int32 or t.device != query.device:
            raise ValueError(f"plan.{name} must be int32 on {query.device}; got {t.dtype} on {t.device}")
    num_reqs = plan.seq_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_reqs == 0:
        return out

    group = num_heads // num_kv_heads
    config = attention_config(head_dim, group, plan.max_query_len, query.element_size())
    tile_programs, search_steps = query_tile_grid(num_tokens, num_reqs, plan.max_query_len, config.block_q)
    num_splits, min_partition = split_layout(plan, num_kv_heads, query.device)
    if num_splits > 1 and (plan.max_query_len != 1 or num_tokens != num_reqs):
        raise ValueError("KV splits are for decode batches (one query token per request)")
    split_acc = split_max = split_sum = out  # unused without splits
    if num_splits > 1:
        split_acc, split_max, split_sum = _split_workspace(num_tokens, num_heads, num_splits, head_dim,
                                                           query.device)

    grid = (tile_programs, num_kv_heads, num_splits)
    _attention_kernel[grid](
        out, split_acc, split_max, split_sum,
        query, k_cache, v_cache, plan.block_tables, plan.seq_lens, plan.query_start_loc,
        scale * LOG2E, num_reqs, search_steps, min_partition, num_heads, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *cache_strides, plan.block_tables.stride(0),
        GROUP=group, BLOCK_Q=config.block_q, BLOCK_M=config.block_m, TILE=config.tile_n,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=config.head_dim_pad, SPLIT=num_splits > 1,
        UPCAST=INTERPRET and query.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        TILE_SEARCH=search_steps > 0, ALIGN=PARTITION_ALIGN, num_warps=config.num_warps, num_stages=config.num_stages)
    if num_splits > 1:
        merge = merge_config(num_splits)
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, split_acc, split_max, split_sum, plan.seq_lens, min_partition, num_heads, num_splits,
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, HEAD_DIM_PAD=config.head_dim_pad,
            SPLITS_PAD=merge.block, ALIGN=PARTITION_ALIGN, num_warps=merge.num_warps)
    return out
