"""Plain-torch twins of the grouped int8 GGUF kernel (csrc/gguf_linear.cpp) and of the integer-dot
kernels (csrc/int4_q8.cpp, csrc/int8g_q8.cpp), with the panel layouts the latter read: the oracles
their tests compare against, and what runs where the kernels are not built.

    codes  [N, K] int8             scales [N, K / 16, 2] float32 (s, m): w = s * q + m
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

INT8G_GROUP = 16


def int8g_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [N, K] int8, scales [N, K / 16, 2] float32 -> weight [N, K] float32, s * q + m (s * q
    is exact for GGUF's codes, so one rounding)."""
    n = codes.shape[0]
    q = codes.view(n, -1, INT8G_GROUP).float()  # [N, G, 16]
    return (q * scales[..., :1] + scales[..., 1:]).view(n, -1)


def int8g_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] float32 or bf16 @ int8g_dequantize(codes, scales)^T + bias -> [M, N] in x's dtype:
    fp32 sums rounded once; with bf16 x the weights are rounded to bf16 first (the model with its
    dequantized weights in bf16)."""
    weight = int8g_dequantize(codes, scales)
    if x.dtype == torch.bfloat16:
        weight = weight.bfloat16().float()
    return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)


def int4f_dequantize(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """qweight [N, K / 2] uint8 (int4_linear's nibble order), scales [N, K / 32, 2] float32 (s, m) ->
    weight [N, K] float32, s * q + m: the int4 layout with fp32 scales (Q4_K's d * sc is not an
    fp16 value)."""
    n = qweight.shape[0]
    q = qweight.view(n, -1, 16)  # [N, G, 16]
    nibbles = torch.cat([q & 15, q >> 4], dim=2).float()  # [N, G, 32]
    return (nibbles * scales[..., :1] + scales[..., 1:]).view(n, -1)


def int4f_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``int8g_linear``'s contract with int4f_dequantize's weights (fp16 x, the GPU kernel's: the
    weights rounded to fp16 as bf16 x's are to bf16)."""
    weight = int4f_dequantize(qweight, scales)
    if x.dtype in (torch.bfloat16, torch.float16):
        weight = weight.to(x.dtype).float()
    return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)


Q8_GROUP = 32  # activations per 8-bit scale (int4_q8_linear)


def quantize_q8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 or bf16 -> (q [M, K] int8, s [M, K / 32] float32), per 32-wide group: a =
    max |x|, s = a / 127, q = round_half_even(x * (127 / a)) (zero where a = 0; a group holding a
    NaN: q zero, s NaN), in fp32."""
    groups = x.float().view(x.shape[0], -1, Q8_GROUP)  # [M, G, 32]
    a = groups.abs().amax(dim=2, keepdim=True)  # [M, G, 1], NaN where the group holds one
    inv = torch.where(a > 0, 127.0 / a, torch.zeros_like(a))
    q = torch.round(torch.nan_to_num(groups * inv, nan=0.0)).clamp(-127, 127).to(torch.int8)
    return q.view(x.shape), (a / 127.0).squeeze(2)


Q8_PANEL = 8  # output columns a panel of ``pack_int4_q8`` interleaves


def pack_int4_q8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 / int4f layout (qweight [N, K / 2] uint8, scales [N, K / 32, 2] fp16 or fp32) as the
    panels csrc/int4_q8.cpp reads: codes [P, K / 8, 32] uint8 with P = ceil(N / 8), where chunk c's
    bytes 4 j .. 4 j + 3 are column 8 p + j's and byte b holds the code of K index 8 c + b (low
    nibble) and 8 c + 4 + b (high); scales [P, K / 32, 2, 8]: each group's 8 d, then 8 m. Columns past
    N are zero. Lossless (``unpack_int4_q8`` inverts it)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    panels = -(-n // Q8_PANEL)
    halves = qweight.view(n, -1, 16)  # [N, G, 16]: low nibbles K 0..15 of the group, high 16..31
    codes = qweight.new_zeros(panels * Q8_PANEL, k)
    codes[:n] = torch.cat([halves & 15, halves >> 4], dim=2).view(n, k)  # [N, K], 0..15
    c = codes.view(panels, Q8_PANEL, k // 8, 2, 4)  # [P, column, chunk, low / high nibble, byte]
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).transpose(1, 2)  # [P, K / 8, column, byte]
    dm = scales.new_zeros(panels * Q8_PANEL, *scales.shape[1:])
    dm[:n] = scales
    return packed.reshape(panels, k // 8, 32).contiguous(), dm.view(panels, Q8_PANEL, -1, 2).permute(0, 2, 3, 1).contiguous()


def unpack_int4_q8(codes: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_int4_q8``'s inverse: (qweight [N, K / 2], scales [N, K / 32, 2])."""
    panels, chunks = codes.shape[:2]
    c = codes.view(panels, chunks, Q8_PANEL, 4).transpose(1, 2)  # [P, column, chunk, byte]
    k_codes = torch.stack([c & 15, c >> 4], dim=3).reshape(panels * Q8_PANEL, chunks * 8)[:n]  # [N, K]
    groups = k_codes.view(n, -1, 2, 16)  # [N, G, low / high half of the group, 16]
    qweight = (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, -1)
    return qweight, scales.permute(0, 3, 1, 2).reshape(panels * Q8_PANEL, -1, 2)[:n].contiguous()


def int4_q8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """csrc/int4_q8.cpp's contract, on the int4 / int4f layout (the kernel reads it as
    ``pack_int4_q8``'s panels): x quantized by ``quantize_q8_groups``, the weights' codes (0..15)
    and (d, m) [N, K / 32, 2] fp16 or fp32; out [M, N] in x's dtype is
    sum_g (d * s) * dot + m * (s * xs) (dot and xs the group's exact integer sums), here as two
    float64 matmuls (the kernel's fp32 sums agree to rounding). The tests' oracle: it builds the
    float64 [N, K] weight every call."""
    q, s = quantize_q8_groups(x)
    n = qweight.shape[0]
    codes = qweight.view(n, -1, 16)  # [N, G, 16]
    w = torch.cat([codes & 15, codes >> 4], dim=2).double()  # [N, G, 32]
    dm = scales.double()  # [N, G, 2]
    s64 = s.double()  # [M, G]
    qs = (q.double().view(x.shape[0], -1, Q8_GROUP) * s64[..., None]).flatten(1)  # [M, K]: q * s
    xs = q.double().view(x.shape[0], -1, Q8_GROUP).sum(2) * s64  # [M, G]: s * sum q
    out = qs @ (w * dm[..., :1]).flatten(1).T + xs @ dm[..., 1].T  # [M, N]
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


INT8G_Q8_OFFSET = 32  # int8g_q8_linear's codes: code + 32, so [-32, 31] (6 bits) must hold them


def int8g_fits_q8(codes: torch.Tensor) -> bool:
    """Whether int8g codes [N, K] fit ``pack_int8g_q8``'s 6 bits."""
    if not codes.numel():
        return True
    low, high = torch.aminmax(codes)
    return int(low) >= -INT8G_Q8_OFFSET and int(high) < INT8G_Q8_OFFSET


def pack_int8g_q8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8g layout (codes [N, K] int8 in [-32, 31]: Q4_*, Q5_K and Q6_K parts; scales
    [N, K / 16, 2] float32 (s, m)) as the panels csrc/int8g_q8.cpp reads: codes [P, K / 4, 32]
    uint8, P = ceil(N / 8), chunk c's bytes 4 j .. 4 j + 3 holding column 8 p + j's codes of K
    4 c .. 4 c + 3, each plus 32; scales [P, K / 16, 2, 8] float32: each group's 8 s, then 8
    m' = m - 32 s (rounded once, in fp32). Columns past N are zero."""
    if not int8g_fits_q8(codes):
        raise ValueError("int8g_q8_linear needs codes in [-32, 31] (Q8_0's 8-bit codes do not fit)")
    n, k = codes.shape
    panels = -(-n // Q8_PANEL)
    shifted = codes.new_zeros(panels * Q8_PANEL, k, dtype=torch.uint8)
    shifted[:n] = (codes.to(torch.int16) + INT8G_Q8_OFFSET).to(torch.uint8)
    packed = shifted.view(panels, Q8_PANEL, k // 4, 4).transpose(1, 2)  # [P, K / 4, column, byte]
    sm = scales.new_zeros(panels * Q8_PANEL, k // INT8G_GROUP, 2)
    sm[:n, :, 0] = scales[..., 0]
    sm[:n, :, 1] = scales[..., 1] - INT8G_Q8_OFFSET * scales[..., 0]
    return packed.reshape(panels, k // 4, 32).contiguous(), sm.view(panels, Q8_PANEL, -1, 2).permute(0, 2, 3, 1).contiguous()


def int8g_q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    """csrc/int8g_q8.cpp's contract, on the int8g layout: x quantized by ``quantize_q8_groups``;
    out [M, N] in x's dtype is sum_h (s * sx) * dot + m * (sx * xs) over the 16-wide groups (dot and
    xs the group's exact integer sums, sx its 32-group's activation scale), here in float64 (the
    kernel's fp32 sums, and its m', agree to rounding)."""
    q, s = quantize_q8_groups(x)
    m = x.shape[0]
    qs = q.double().view(m, -1, Q8_GROUP) * s.double()[..., None]  # [M, G, 32]: q * sx
    sw = scales.double()  # [N, K / 16, 2]
    w = (codes.double().view(codes.shape[0], -1, INT8G_GROUP) * sw[..., :1]).flatten(1)  # [N, K]: s * code
    out = qs.flatten(1) @ w.T + qs.view(m, -1, INT8G_GROUP).sum(2) @ sw[..., 1].T  # [M, N]
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
