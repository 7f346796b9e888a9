"""Tandem's kernels: paged attention, KV-cache writes, norms, rotary, activations.

This is the one place that dispatches by device; models call these functions
and nothing else:

- CUDA tensors -> the Triton kernels (``attention``, ``cache_ops``, ``norms``,
  ``rotary``, ``activations``, ``int4_matmul``: imported on first use, so a CPU process never loads Triton),
  never the C++ CPU kernels (``_cpu_fast`` checks the device before it builds them);
- CPU tensors -> the fused C++ kernels (``tandem_kernels.cpu``, built once per
  machine) when they are available;
- otherwise -> ``tandem_kernels.reference``, the plain-torch twin of every op that is
  also the test oracle.

Contracts are the reference's; the fast versions check shapes, strides and
dtypes. Some work in place (``fused_add_rms_norm``, ``apply_rotary``): callers
always use the returned tensors.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from tandem_kernels import cpu, gguf_reference, reference
from tandem_kernels.reference import (AttentionPlan, VarlenPlan, kv_cache_shape, plan_varlen,  # noqa: F401
                               rotary_cos_sin)

_fused_cpu: list[bool] = []  # [cpu.available()], decided on first use


def _triton(module: str):
    return importlib.import_module(f"tandem_kernels.{module}")  # sys.modules after the first call


def _cpu_fast(x: torch.Tensor) -> bool:
    """Whether x goes to the fused C++ kernels. The device is checked first: asking
    ``cpu.available()`` builds them (g++, tens of seconds), which a CUDA process must never do."""
    if not x.is_cpu:
        return False
    if not _fused_cpu:
        _fused_cpu.append(cpu.available())
    return _fused_cpu[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        return _triton("norms").rms_norm(x, weight, eps)
    if _cpu_fast(x):
        return cpu.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        return _triton("norms").fused_add_rms_norm(x, residual, weight, eps)
    if _cpu_fast(x):
        return cpu.fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def apply_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_dim: int, is_neox: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    if query.is_cuda:
        return _triton("rotary").apply_rotary(positions, query, key, cos_sin_cache, head_dim, is_neox)
    if _cpu_fast(query):
        return cpu.apply_rotary(positions, query, key, cos_sin_cache, head_dim, is_neox)
    return reference.apply_rotary(positions, query, key, cos_sin_cache, head_dim, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] = gate | up -> [num_tokens, d]."""
    if x.is_cuda:
        return _triton("activations").silu_and_mul(x)
    if _cpu_fast(x):
        return cpu.silu_and_mul(x)
    return reference.silu_and_mul(x)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., K] @ W^T + bias, W the int4 layout (qweight [N, K / 2] uint8, scales [N, K / 32, 2]):
    fp16 scales are ``reference.int4_linear``'s contract, fp32 ones (int4f)
    ``gguf_reference.int4f_linear``'s. CUDA: the Triton dequant-GEMM (bf16 / fp16 x)."""
    int4f = scales.dtype == torch.float32
    if x.is_cuda:
        return _triton("int4_matmul").int4_linear(x, qweight, scales, bias)
    if _cpu_fast(x):
        return cpu.int4_linear(x, qweight, scales, bias)
    return (gguf_reference.int4f_linear if int4f else reference.int4_linear)(x, qweight, scales, bias)


def int4_q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """4-bit weights (``gguf_reference.pack_int4_q8``'s panels) against x [M, K] quantized to 8 bits
    per 32 values, integer dot products: ``gguf_reference.int4_q8_linear``'s contract. CPU only."""
    if x.is_cuda:
        raise NotImplementedError("int4_q8_linear runs on the CPU only")
    if _cpu_fast(x):
        return cpu.int4_q8_linear(x, codes, scales, n, bias)
    return gguf_reference.int4_q8_linear(x, *gguf_reference.unpack_int4_q8(codes, scales, n), bias)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] -> [rows] int64: each row's first maximum (greedy sampling's token IDs).
    On CUDA torch's own reduction."""
    if x.is_cuda:
        return reference.argmax_rows(x)
    if _cpu_fast(x) and x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1:
        return cpu.argmax_rows(x)
    return reference.argmax_rows(x)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, prompt_seen: torch.Tensor,
                    output_counts: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """Repetition / frequency / presence penalties in place on logits [R, V] float32, from
    per-sequence token tables (reference.apply_penalties has the contract). On CUDA the
    reference's tensor ops."""
    if _cpu_fast(logits):
        return cpu.apply_penalties(logits, rows, prompt_seen, output_counts, slots, repetition, frequency, presence)
    return reference.apply_penalties(logits, rows, prompt_seen, output_counts, slots, repetition, frequency, presence)


def penalized_argmax(logits: torch.Tensor, rows: torch.Tensor, prompt_seen: torch.Tensor,
                     output_counts: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
                     frequency: torch.Tensor, presence: torch.Tensor, count: bool) -> torch.Tensor:
    """Greedy tokens [R] of logits [R, V] after the penalties, optionally counted in the tables
    (reference.penalized_argmax has the contract). On CUDA the reference's tensor ops."""
    if _cpu_fast(logits) and logits.dtype in (torch.float32, torch.bfloat16) and logits.stride(-1) == 1:
        return cpu.penalized_argmax(logits, rows, prompt_seen, output_counts, slots, repetition, frequency,
                                    presence, count)
    return reference.penalized_argmax(logits, rows, prompt_seen, output_counts, slots, repetition, frequency,
                                      presence, count)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if key.is_cuda:
        return _triton("cache_ops").write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    if _cpu_fast(key):
        return cpu.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    return reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def plan_attention(block_tables: torch.Tensor, seq_lens: list[int], query_lens: list[int],
                   block_size: int, seq_lens_tensor: Optional[torch.Tensor] = None,
                   query_start_tensor: Optional[torch.Tensor] = None) -> AttentionPlan | VarlenPlan:
    """A step's attention metadata, shared by every layer: tensors only (``VarlenPlan``) for
    the Triton and fused CPU kernels, the reference's host-built ``AttentionPlan`` otherwise.
    The optional tensors: seq_lens and the query start offsets, int32, on the device already."""
    if block_tables.is_cuda or _cpu_fast(block_tables):
        return plan_varlen(block_tables, seq_lens, query_lens, seq_lens_tensor, query_start_tensor)
    return reference.plan_attention(block_tables, seq_lens, query_lens, block_size)


def qkv_attention(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: Optional[torch.Tensor],
                  is_neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, plan: AttentionPlan | VarlenPlan, num_heads: int,
                  num_kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """A layer's attention from its fused projection: qkv [num_tokens, (heads + 2 kv_heads) * d]
    = q | k | v -> rotary on q, k (unless cos_sin_cache is None), K/V into the cache, attention
    over it: [num_tokens, heads * d]. One fused call on the CPU; the ops below in a row elsewhere.
    qkv may be modified in place."""
    if _cpu_fast(qkv) and isinstance(plan, VarlenPlan):
        return cpu.attention_block(qkv, positions, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping,
                                   plan, num_heads, num_kv_heads, head_dim, scale)
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if cos_sin_cache is not None:
        q, k = apply_rotary(positions, q, k, cos_sin_cache, head_dim, is_neox)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return paged_attention(q, k, v, k_cache, v_cache, plan, scale).view(num_tokens, q_size)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan | VarlenPlan,
                    scale: float) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim]; key/value: this step's, already in the caches."""
    if query.is_cuda:
        return _triton("attention").paged_attention(query, key, value, k_cache, v_cache, plan, scale)
    if isinstance(plan, VarlenPlan) and _cpu_fast(query):
        return cpu.paged_attention(query, k_cache, v_cache, plan.block_tables, plan.seq_lens,
                                   plan.query_start_loc, scale)
    return reference.paged_attention(query, key, value, k_cache, v_cache, plan, scale)
