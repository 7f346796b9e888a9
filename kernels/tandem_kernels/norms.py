"""Triton RMSNorm, alone and fused with the residual add: one program per token row.

It rounds where the reference (HF's order) rounds: x + residual in the model
dtype, the normalization in fp32, the cast back, then the weight product.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tandem_kernels.launch_config import row_config


@triton.jit
def _rms_norm_kernel(out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, eps, hidden,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    y = (xf * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [num_tokens, hidden] with a contiguous last dim; got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{hidden}] {x.dtype}; got {tuple(weight.shape)} {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1):
        raise ValueError("residual must match x in shape, dtype and a contiguous last dim")
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    if num_tokens:
        config = row_config(hidden)
        _rms_norm_kernel[(num_tokens,)](
            out, residual_out if residual is not None else out, x,
            residual if residual is not None else x, weight, eps, hidden,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            residual_out.stride(0) if residual is not None else 0,
            HAS_RESIDUAL=residual is not None, BLOCK=config.block, num_warps=config.num_warps)
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden] -> [num_tokens, hidden]."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); both [num_tokens, hidden]."""
    return _launch(x, residual, weight, eps)
