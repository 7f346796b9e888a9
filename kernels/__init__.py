"""Tandem's kernels: paged attention, KV-cache writes, norms, rotary.

This is the one place that dispatches by device; models call these functions
and nothing else. CUDA tensors go to the Triton kernels (``attention``,
``cache_ops``, ``norms``, ``rotary``: imported on first use, so a CPU process
never loads Triton); everything else to ``kernels.reference``, the plain-torch
twin of every op that is also the test oracle.

Contracts are the reference's; the Triton versions check shapes, strides and
dtypes, and ``apply_rotary`` on CUDA rotates q and k in place.
"""

from __future__ import annotations

import importlib

import torch

from kernels import reference
from kernels.reference import AttentionPlan, VarlenPlan, plan_varlen, rotary_cos_sin  # noqa: F401


def _triton(module: str):
    return importlib.import_module(f"kernels.{module}")  # sys.modules after the first call


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        return _triton("norms").rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        return _triton("norms").fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def apply_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_dim: int, is_neox: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    if query.is_cuda:
        return _triton("rotary").apply_rotary(positions, query, key, cos_sin_cache, head_dim, is_neox)
    return reference.apply_rotary(positions, query, key, cos_sin_cache, head_dim, is_neox)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if key.is_cuda:
        return _triton("cache_ops").write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    return reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def plan_attention(block_tables: torch.Tensor, seq_lens: list[int], query_lens: list[int],
                   block_size: int) -> AttentionPlan | VarlenPlan:
    """A step's attention metadata, shared by every layer: the Triton kernel's
    ``VarlenPlan`` on CUDA, the reference's ``AttentionPlan`` elsewhere."""
    if block_tables.is_cuda:
        return plan_varlen(block_tables, seq_lens, query_lens)
    return reference.plan_attention(block_tables, seq_lens, query_lens, block_size)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan | VarlenPlan,
                    scale: float) -> torch.Tensor:
    if query.is_cuda:
        return _triton("attention").paged_attention(query, key, value, k_cache, v_cache, plan, scale)
    return reference.paged_attention(query, key, value, k_cache, v_cache, plan, scale)
