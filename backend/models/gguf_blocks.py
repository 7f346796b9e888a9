"""GGUF's K-quant and Q8_0 blocks decoded exactly, into the grouped int8 layout the CPU kernel
reads (``tandem_kernels.gguf_reference.int8g_dequantize``):

    codes  [N, K] int8             the block's integer code per weight
    scales [N, K / 16, 2] float32  (s, m) per row and 16-wide group: w = s * q + m

Each format's own dequantization is s * q + m with s and m in fp32 and s * q exact (the code has at
most 6 bits and s at most 19 significant bits), so w holds the format's value exactly. Block layouts
(bytes, little endian, 256 weights a super-block unless said):

    Q8_0  (34, 32 weights)  d fp16 | qs int8[32]                                     w = d q
    Q4_K  (144)  d fp16 | dmin fp16 | scales[12] (8 x 6-bit sc, 8 x 6-bit mn) | qs[128]
                 sub-block j (32 weights): w = d sc_j q - dmin mn_j, q a nibble of
                 qs[32 (j // 2) : 32 (j // 2) + 32], low for even j, high for odd
    Q5_K  (176)  d | dmin | scales[12] | qh[32] | qs[128]: Q4_K's nibble + bit j of qh[i] as bit 4
    Q6_K  (210)  ql[128] | qh[64] | scales int8[16] | d fp16; 16-weight groups: w = d sc_g (q - 32),
                 q = 4 bits of ql + 2 bits of qh (see ``_q6_codes``)
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 16  # weights per (s, m) pair in the int8g layout
SUPER = 256
BLOCK_BYTES = {"Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {"Q8_0": 32, "Q4_K": SUPER, "Q5_K": SUPER, "Q6_K": SUPER}


def _f16(raw: np.ndarray) -> np.ndarray:
    """raw [..., 2] uint8 -> [...] float32 (an fp16 read little endian)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes [B, 12] -> (sc, mn) [B, 8] uint8 of 6 bits each: sub-blocks
    0-3 in the low 6 bits of bytes 0-3 (sc) and 4-7 (mn); sub-blocks 4-7 take their low 4 bits
    from bytes 8-11 (sc low nibble, mn high nibble) and their top 2 bits from the top 2 bits of
    bytes 0-3 (sc) and 4-7 (mn)."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def _nibble_codes(qs: np.ndarray) -> np.ndarray:
    """qs [B, 128] -> [B, 8, 32] codes: sub-block j from byte chunk j // 2, low nibble if j even."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return ((chunks >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(-1, 8, 32)


def _q6_codes(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """ql [B, 128], qh [B, 64] -> [B, 256] int codes - 32. Each half h of 128 weights: element
    32 c + l (c = 0..3) takes its low 4 bits from ql[64 h + 32 (c % 2) + l] (low nibble for c < 2,
    high for c >= 2) and its top 2 bits from bits 2c, 2c+1 of qh[32 h + l]."""
    ql = ql.reshape(-1, 2, 2, 32)  # [B, half, c % 2, l]
    low = np.concatenate([ql & 15, ql >> 4], axis=2)  # [B, half, c, l]
    qh = qh.reshape(-1, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3  # [B, half, c, l]
    return (low | (high << 4)).astype(np.int16).reshape(-1, SUPER) - 32


def decode_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """raw [B, block bytes] uint8 of one ``kind`` -> (codes [B, W] int8, scales [B, W / 16, 2]
    float32), W the block's weights."""
    blocks = raw.shape[0]
    if kind == "Q8_0":
        d = _f16(raw[:, 0:2])  # [B]
        codes = raw[:, 2:].view(np.int8)
        s = np.repeat(d[:, None], 2, axis=1)
        return codes, np.stack([s, np.zeros_like(s)], axis=2)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(raw[:, 0:2]), _f16(raw[:, 2:4])
        sc, mn = _k_scales(raw[:, 4:16])
        if kind == "Q4_K":
            codes = _nibble_codes(raw[:, 16:144])
        else:
            qh = raw[:, 16:48].reshape(-1, 1, 32)
            bits = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [B, 8, 32]
            codes = _nibble_codes(raw[:, 48:176]) | (bits << 4)
        s = d[:, None] * sc.astype(np.float32)  # [B, 8]
        m = -(dmin[:, None] * mn.astype(np.float32))
        pairs = np.stack([s, m], axis=2)  # [B, 8, 2] per 32 weights
        return codes.astype(np.int8).reshape(blocks, SUPER), np.repeat(pairs, 2, axis=1)
    if kind == "Q6_K":
        codes = _q6_codes(raw[:, 0:128], raw[:, 128:192]).astype(np.int8)
        s = _f16(raw[:, 208:210])[:, None] * raw[:, 192:208].view(np.int8).astype(np.float32)  # [B, 16]
        return codes, np.stack([s, np.zeros_like(s)], axis=2)
    raise ValueError(f"no block decoder for GGUF type {kind}")


def int8g_from_gguf(data: np.ndarray, kind: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF tensor's raw bytes of type ``kind`` (Q8_0, Q4_K, Q5_K, Q6_K; or Q4_0 / Q4_1, decoded
    by the int4 layout's reader), row-major over [N, K] -> (codes [N, K] int8, scales [N, K / 16, 2]
    float32) holding the values ``gguf.quants.dequantize`` gives."""
    n, k = shape
    if kind in ("Q4_0", "Q4_1"):
        from backend.models.int4_weights import int4_from_gguf

        q, ds = int4_from_gguf(data, kind, shape)  # [N, K / 2] uint8, [N, K / 32, 2] fp16
        q = q.view(n, -1, 16)
        codes = torch.cat([q & 15, q >> 4], dim=2).reshape(n, k).to(torch.int8)
        return codes.contiguous(), ds.float().repeat_interleave(2, dim=1).contiguous()
    if kind not in BLOCK_BYTES:
        raise ValueError(f"no block decoder for GGUF type {kind}")
    if k % BLOCK_WEIGHTS[kind]:
        raise ValueError(f"a {kind} tensor needs rows of a multiple of {BLOCK_WEIGHTS[kind]} weights; got {k}")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, BLOCK_BYTES[kind])
    codes, scales = decode_blocks(raw, kind)
    codes = torch.from_numpy(np.ascontiguousarray(codes)).reshape(n, k)
    scales = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)).reshape(n, k // GROUP, 2)
    return codes, scales


INT4F_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit codes with one (s, m) per 32 weights


def int4f_from_gguf(data: np.ndarray, kind: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0, Q4_1 or Q4_K tensor -> (qweight [N, K / 2] uint8 in the int4 kernel's nibble order,
    scales [N, K / 32, 2] float32): ``int8g_from_gguf``'s values in 6 bits a weight."""
    from backend.models.int4_weights import pack_nibbles

    if kind not in INT4F_TYPES:
        raise ValueError(f"GGUF type {kind} has no 4-bit form")
    n, k = shape
    codes, scales = int8g_from_gguf(data, kind, shape)  # scales repeat each 32-group's pair twice
    qweight = pack_nibbles(codes.view(torch.uint8).view(n, k // 32, 32))
    return qweight, scales[:, ::2].contiguous()
