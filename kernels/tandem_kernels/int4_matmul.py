"""Triton dequant-GEMM for the int4 weight layout: y [M, N] = x [M, K] @ W^T + bias, with W's 4-bit
codes dequantized in registers (never written out), bf16 or fp16 x, fp32 sums.

The layout (``tandem_kernels.reference.int4_dequantize``, the CPU kernel's csrc/int4_linear.cpp)::

    qweight [N, K / 2] uint8     group g of row n is bytes [16 g, 16 g + 16): byte i holds element
                                 32 g + i in its low nibble and 32 g + 16 + i in its high one
    scales  [N, K / 32, 2]       (d, m) per row and 32-wide group, float16 (``int4``) or float32
                                 (``int4f``, ``gguf_reference.int4f_dequantize``); w = d * q + m

A K step of BLOCK_K inputs reads BLOCK_K / 2 bytes a weight row. The sum over k does not care in
which order k runs, so the nibbles are not put back in element order: the low nibbles of a step
(elements 32 g + i, i < 16) form one [BLOCK_N, BLOCK_K / 2] tile and the high ones (32 g + 16 + i)
another, and x is loaded in the same two orders, giving two tl.dot calls a step::

    bytes  [n, 16 g + i]  --& 15-->  w_lo [n, 16 g + i] = w[n, 32 g + i]       x_lo[m, 16 g + i] = x[m, 32 g + i]
                          -->> 4-->  w_hi [n, 16 g + i] = w[n, 32 g + 16 + i]  x_hi[m, 16 g + i] = x[m, 32 g + 16 + i]

Each group's (d, m) is loaded once a step ([BLOCK_N, BLOCK_K / 32]) and spread over its 16 bytes.
Each weight is d * q + m in fp32 (d * q is exact: one rounding, the reference's value), rounded to
x's dtype (the model with its dequantized weights in the serving dtype: the reference's rounding
for bf16 and fp16 x), then the products are summed in fp32 on the tensor cores and the bias added
in fp32 before the one rounding to x's dtype. Sums run in another order than the reference's, so
results agree to rounding, not bit for bit.

Checked under Triton's interpreter (tests/test_int4_matmul.py) and by compiling for sm_80 / sm_90a
(tests/test_kernel_compile.py); it has not run on a GPU yet.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from tandem_kernels.launch_config import int4_matmul_config

GROUP = 32  # weights per (d, m) pair along K
_GROUP = tl.constexpr(GROUP)  # the same, for the kernel (globals a kernel reads are constexprs)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float16, torch.float32)  # int4, int4f
# The interpreter (Triton 3.9) mishandles half-precision dots: bf16 operands give results wrong by
# orders of magnitude (see tandem_kernels.attention), fp16 ones are summed in fp16; and its fp32 ->
# bf16 casts truncate. There the tiles stay fp32 holding x's dtype's values (bf16 rounded to nearest
# even by hand; half-precision products are exact in fp32, so the sums are the same ones).
# Compiled, the dots take bf16 / fp16 operands (tensor cores) with fp32 accumulation.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_to_bf16(v):
    """fp32 v rounded to the nearest bf16 value (ties to even), still fp32. Only for the
    interpreter, whose fp32 -> bf16 casts truncate (compiled casts round to nearest even)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _int4_matmul_kernel(out_ptr, x_ptr, qweight_ptr, scales_ptr, bias_ptr, M, N, K, stride_xm, stride_om,
                        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        UPCAST: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 32
    # Programs in bands of GROUP_M along M sweep the same weight rows together (L2 reuse).
    pid = tl.program_id(0)
    programs_m = tl.cdiv(M, BLOCK_M)
    programs_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * programs_n)
    first_m = band * GROUP_M
    band_m = tl.minimum(programs_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * programs_n)) % band_m
    pid_n = (pid % (GROUP_M * programs_n)) // band_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] weight rows (outputs)
    row_ok = rows < M
    col_ok = cols < N
    byte = tl.arange(0, HALF)  # [HALF] byte of a step: group byte // 16, nibble pair byte % 16
    lo_k = (byte // 16) * _GROUP + byte % 16  # [HALF] the element its low nibble holds, in the step
    groups = K // _GROUP
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    q_rows = qweight_ptr + cols.to(tl.int64)[:, None] * (K // 2)  # [BLOCK_N, 1]
    s_rows = scales_ptr + cols.to(tl.int64)[:, None] * (groups * 2)  # [BLOCK_N, 1]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        group = k0 // _GROUP + byte // 16  # [HALF] each byte's (d, m) group
        if EVEN_K:
            x_mask = row_ok[:, None]
            w_mask = col_ok[:, None]
        else:
            k_ok = group < groups
            x_mask = row_ok[:, None] & k_ok[None, :]
            w_mask = col_ok[:, None] & k_ok[None, :]
        packed = tl.load(q_rows + k0 // 2 + byte[None, :], mask=w_mask, other=0)  # [BLOCK_N, HALF] uint8
        # (d, m) once per group, then spread over its 16 bytes: [BLOCK_N, GROUPS] -> [BLOCK_N, HALF]
        step_group = k0 // _GROUP + tl.arange(0, GROUPS)  # [GROUPS]
        s_mask = col_ok[:, None] & (step_group < groups)[None, :]
        d = tl.load(s_rows + step_group[None, :] * 2, mask=s_mask, other=0.0).to(tl.float32)  # [BLOCK_N, GROUPS]
        m = tl.load(s_rows + step_group[None, :] * 2 + 1, mask=s_mask, other=0.0).to(tl.float32)
        d = tl.reshape(tl.broadcast_to(d[:, :, None], (BLOCK_N, GROUPS, 16)), (BLOCK_N, HALF))
        m = tl.reshape(tl.broadcast_to(m[:, :, None], (BLOCK_N, GROUPS, 16)), (BLOCK_N, HALF))
        x_lo = tl.load(x_rows + k0 + lo_k[None, :], mask=x_mask, other=0.0)  # [BLOCK_M, HALF]
        x_hi = tl.load(x_rows + k0 + _GROUP // 2 + lo_k[None, :], mask=x_mask, other=0.0)
        w_lo = (packed & 15).to(tl.float32) * d + m  # [BLOCK_N, HALF]
        w_hi = (packed >> 4).to(tl.float32) * d + m
        if UPCAST:  # the interpreter (see INTERPRET): the same values, in fp32
            if x_lo.dtype == tl.bfloat16:
                w_lo, w_hi = _round_to_bf16(w_lo), _round_to_bf16(w_hi)
            else:
                w_lo, w_hi = w_lo.to(x_lo.dtype).to(tl.float32), w_hi.to(x_lo.dtype).to(tl.float32)
            x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
        else:
            w_lo, w_hi = w_lo.to(x_lo.dtype), w_hi.to(x_lo.dtype)
        acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision="ieee" if UPCAST else "tf32")
        acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision="ieee" if UPCAST else "tf32")

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if UPCAST and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = _round_to_bf16(acc)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``tandem_kernels.reference.int4_linear``'s contract (fp16 scales; fp32 ones:
    ``gguf_reference.int4f_linear``'s) for bf16 / fp16 x: x [..., K] @ dequant(qweight [N, K / 2]
    uint8, scales [N, K / 32, 2])^T + bias [N] -> [..., N] in x's dtype."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"int4_linear on the GPU takes bfloat16 or float16 x; got {x.dtype}")
    k = x.shape[-1]
    n = qweight.shape[0]
    if k % GROUP or qweight.dtype != torch.uint8 or qweight.shape != (n, k // 2) or not qweight.is_contiguous():
        raise ValueError(f"qweight must be [N, {k // 2}] uint8, contiguous, for x [..., {k}] (K a multiple of "
                         f"{GROUP}); got {tuple(qweight.shape)} {qweight.dtype}")
    if scales.dtype not in SCALE_DTYPES or scales.shape != (n, k // GROUP, 2) or not scales.is_contiguous():
        raise ValueError(f"scales must be [{n}, {k // GROUP}, 2] float16 or float32, contiguous; "
                         f"got {tuple(scales.shape)} {scales.dtype}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be [{n}], contiguous; got {tuple(bias.shape)}")
    if not (x.device == qweight.device == scales.device) or (bias is not None and bias.device != x.device):
        raise ValueError("x, qweight, scales and bias must be on one device")
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m and n:
        config = int4_matmul_config(m, n, k)
        grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
        _int4_matmul_kernel[grid](
            out, x2, qweight, scales, bias if bias is not None else out, m, n, k, x2.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
            UPCAST=INTERPRET,
            num_warps=config.num_warps, num_stages=config.num_stages)
    return out.view(*x.shape[:-1], n)
