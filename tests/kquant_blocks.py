"""Random GGUF blocks written by the spec's byte layouts (the ``gguf`` package cannot write
K-quants): random code and scale bytes, with the fp16 super-block scales set to finite values of a
size that keeps the weights small."""

from __future__ import annotations

import numpy as np

BLOCK_BYTES = {"Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {"Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
# where each type keeps its fp16 scales, and their size: weights of a few hundredths, about zero
# mean (dmin = E[q] d) as a real model's are, so random models' logits stay moderate
_FP16_FIELDS = {"Q8_0": [(0, 3e-4)], "Q4_K": [(0, 1e-4), (2, 7.5e-4)],
                "Q5_K": [(0, 6.5e-5), (2, 1e-3)], "Q6_K": [(208, 6.5e-5)]}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, cols / block weights * block bytes] uint8: a ``kind`` tensor of shape [rows, cols]."""
    rng = np.random.default_rng(seed)
    blocks = rows * cols // BLOCK_WEIGHTS[kind]
    raw = rng.integers(0, 256, size=(blocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    for offset, size in _FP16_FIELDS[kind]:
        value = (rng.uniform(0.5, 1.5, size=blocks) * size).astype(np.float16)
        raw[:, offset:offset + 2] = value.view(np.uint8).reshape(blocks, 2)
    return raw.reshape(rows, -1)


def q2_k_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A Q2_K tensor (84 bytes a 256-weight block: scales[16], qs[64], d fp16, dmin fp16): a type
    quantization='gguf' does not serve packed."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // 256, 84), dtype=np.uint8)
    raw[:, 80:84] = np.array([1e-4, 1e-4], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, -1)
