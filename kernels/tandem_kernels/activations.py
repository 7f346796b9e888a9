"""Triton SiLU-and-multiply (the gated MLP's activation): out = silu(gate) * up.

x is [num_tokens, 2 * d] = gate | up, as a fused gate-up projection writes it. One program
per (token, block of output columns); the product is computed in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.launch_config import activation_config


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``tandem_kernels.reference.silu_and_mul``: x [num_tokens, 2 * d]
    (contiguous last dim) -> [num_tokens, d] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [num_tokens, 2 * d] with a contiguous last dim; got {tuple(x.shape)}")
    num_tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    if num_tokens and width:
        config = activation_config(width)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, config.block))](
            out, x, width, x.stride(0), out.stride(0), BLOCK=config.block, num_warps=config.num_warps)
    return out
