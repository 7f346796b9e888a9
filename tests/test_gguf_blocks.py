"""GGUF's Q8_0 / Q4_K / Q5_K / Q6_K blocks (and Q4_0 / Q4_1) decoded into the grouped int8 layout
exactly, against the ``gguf`` package's dequantize; the grouped kernel against its reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kquant_blocks import random_blocks

from backend.models.gguf_blocks import int8g_from_gguf
from tandem_kernels import gguf_reference

gguf = pytest.importorskip("gguf")

KINDS = ["Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def oracle(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(shape)


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_decode_exactly_as_ggufs_dequantize(kind):
    shape = (6, 512)
    raw = random_blocks(kind, *shape, seed=KINDS.index(kind))
    codes, scales = int8g_from_gguf(raw, kind, shape)
    assert codes.dtype == torch.int8 and scales.shape == (6, 512 // 16, 2)
    assert torch.equal(gguf_reference.int8g_dequantize(codes, scales), oracle(raw, kind, shape))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_also_fit_the_grouped_layout(kind):
    shape = (5, 96)
    rng = np.random.default_rng(1)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
    codes, scales = int8g_from_gguf(raw, kind, shape)
    assert torch.equal(gguf_reference.int8g_dequantize(codes, scales), oracle(raw, kind, shape))


def test_unknown_block_type_is_refused_by_name():
    with pytest.raises(ValueError, match="Q2_K"):
        int8g_from_gguf(np.zeros((1, 84), np.uint8), "Q2_K", (1, 256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_grouped_kernel_matches_its_reference(dtype, rows):
    import tandem_kernels.cpu

    if not tandem_kernels.cpu.available():
        pytest.skip("needs the fused CPU kernels")
    shape = (21, 512)  # N not a multiple of the kernel's 8-row panels
    codes, scales = int8g_from_gguf(random_blocks("Q4_K", *shape, seed=3), "Q4_K", shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(shape[0])
    got = tandem_kernels.cpu.gguf_int8g_linear(x, codes, scales, bias)
    want = gguf_reference.int8g_linear(x, codes, scales, bias)
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    alone = tandem_kernels.cpu.gguf_int8g_linear(x[-1:], codes, scales, bias)
    assert torch.equal(alone[0], got[-1])  # batch-invariant: a row's sums never depend on M
