"""The int4 weight layout the CPU kernel reads (``tandem_kernels.reference.int4_dequantize``), and
the ways weights get into it: quantized at load (``quantization="int4"``), or repacked from GGUF's
Q4_0 / Q4_1 blocks without changing a value.

    qweight [N, K / 2] uint8        two 4-bit values a byte, in GGUF's order inside each 32-group
    scales  [N, K / 32, 2] float16  (d, m): w = d * q + m

fp16 (d, m) is what Q4_1 stores: 5 bits a weight in all, and Q4_0's d * (q - 8) is d * q + (-8 d)
exactly (a power-of-two multiple of an fp16 value is an fp16 value unless it overflows).
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32
_FP16_MAX = 65504.0


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float (K a multiple of 32) -> (qweight, scales): round to nearest, asymmetric
    per row and 32-wide group (Q4_1's form): d = (max - min) / 15 and m = min, both rounded to
    fp16, q = clamp(round((w - m) / d), 0, 15)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int4 quantization needs in_features to be a multiple of {GROUP}; got {k}")
    w = weight.detach().float().view(n, k // GROUP, GROUP)  # [N, G, 32]
    low, high = w.amin(dim=2), w.amax(dim=2)  # [N, G]
    if max(high.abs().max().item(), low.abs().max().item(), 0.0) > _FP16_MAX:
        raise ValueError("int4 quantization stores fp16 group scales: a weight exceeds float16's range")
    d = ((high - low) / 15).half().float()
    m = low.half().float()
    safe_d = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((w - m.unsqueeze(2)) / safe_d.unsqueeze(2)).clamp_(0, 15).to(torch.uint8)  # [N, G, 32]
    return pack_nibbles(q), torch.stack([d, m], dim=2).half().contiguous()


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, G, 32] uint8 values 0..15 -> [N, G * 16] uint8: element i in byte i's low nibble,
    element 16 + i in its high one."""
    n = q.shape[0]
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(n, -1).contiguous()


# GGUF block sizes in bytes per 32 weights: Q4_0 = fp16 d + 16 bytes; Q4_1 = fp16 d, fp16 m + 16 bytes.
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def int4_from_gguf(blocks: np.ndarray, kind: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q4_0 or Q4_1 tensor's raw bytes (any shape holding N * K / 32 blocks, row-major over
    [N, K]) -> (qweight, scales) holding the same values as ``gguf.quants.dequantize``."""
    n, k = shape
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, k // GROUP, GGUF_BLOCK_BYTES[kind])
    if kind == "Q4_0":
        d = raw[..., :2].copy().view(np.float16)[..., 0]  # [N, G]
        m = (d.astype(np.float32) * -8).astype(np.float16)
        if not np.isfinite(m).all():
            raise ValueError("a Q4_0 scale too large for int4's fp16 m = -8 d")
        qs = raw[..., 2:]
    else:
        d = raw[..., :2].copy().view(np.float16)[..., 0]
        m = raw[..., 2:4].copy().view(np.float16)[..., 0]
        qs = raw[..., 4:]
    scales = torch.from_numpy(np.stack([d, m], axis=2).astype(np.float16))
    return torch.from_numpy(np.ascontiguousarray(qs)).reshape(n, -1), scales.contiguous()
