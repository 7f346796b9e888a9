"""The int4 linear: its layout against GGUF's own dequantization (bit for bit), the C++ kernel
against its plain-torch twins (fp16 scales: reference.int4_linear; float32 scales, the int4f form
of Q4_K / AWQ / GPTQ: gguf_reference.int4f_linear), and int4 quantization at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tandem_kernels.cpu as cpu
from backend.models.int4_weights import int4_from_gguf, quantize_int4
from tandem_kernels import gguf_reference, reference

gguf = pytest.importorskip("gguf")
needs_kernels = pytest.mark.skipif(not cpu.available(), reason="the fused CPU kernels are not built here")


def gguf_tensor(kind: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A random [n, k] tensor quantized by the gguf package: (raw blocks, gguf's dequantization)."""
    data = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    data[0, :32] = 0  # an all-zero group: d = 0
    data[-1, -32:] *= 1000  # a wide group
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(data, qtype)
    return raw, gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_repacked_gguf_blocks_dequantize_to_gguf_values_bit_for_bit(kind):
    raw, expected = gguf_tensor(kind, 6, 96)
    qweight, scales = int4_from_gguf(raw, kind, (6, 96))
    assert qweight.shape == (6, 48) and qweight.dtype == torch.uint8 and scales.shape == (6, 3, 2)
    assert torch.equal(reference.int4_dequantize(qweight, scales), torch.from_numpy(expected))


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 40])  # dequantized in registers (<= 4 rows) and in a panel
def test_kernel_dequantizes_gguf_blocks_bit_for_bit(kind, rows):
    # x = rows of the identity: each output is one weight times 1 plus zeros, so exactly that weight.
    n, k = 19, 64
    raw, expected = gguf_tensor(kind, n, k, seed=1)
    qweight, scales = int4_from_gguf(raw, kind, (n, k))
    eye = torch.eye(k)
    got = torch.cat([cpu.int4_linear(eye[i:i + rows], qweight, scales, None) for i in range(0, k, rows)])
    assert torch.equal(got.t(), torch.from_numpy(expected))


def random_int4(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=gen) * 0.02
    m = -8 * d + torch.randn(n, k // 32, generator=gen) * 0.01
    return qweight, torch.stack([d, m], dim=2).half()


def random_int4f(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """int4f's float32 (d, m) as Q4_K makes them: d = fp16 super-scale x 6-bit sub-scale (not an
    fp16 value in general), m = -(fp16 dmin x 6-bit sub-min)."""
    qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    super_d = (torch.rand(n, 1, generator=gen) * 1e-3).half().float()
    super_min = (torch.rand(n, 1, generator=gen) * 1e-3).half().float()
    d = super_d * torch.randint(0, 64, (n, k // 32), generator=gen)
    m = -super_min * torch.randint(0, 64, (n, k // 32), generator=gen)
    return qweight, torch.stack([d, m], dim=2)


SCALE_FORMS = {"int4": (random_int4, reference.int4_linear), "int4f": (random_int4f, gguf_reference.int4f_linear)}


# odd M and N; K multiples of 32; 1-4 rows in registers, more through the panel (with tails)
@needs_kernels
# (2 and 17 rows, K = 288: the AVX2 build's 2 x 2 tiles and their odd tails)
@pytest.mark.parametrize("m, k, n", [(1, 32, 5), (2, 288, 7), (3, 64, 12), (4, 96, 17), (5, 128, 9), (17, 288, 7),
                                     (33, 64, 37), (130, 256, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", SCALE_FORMS)
def test_int4_linear_equals_its_reference(m, k, n, dtype, form):
    make, reference_linear = SCALE_FORMS[form]
    gen = torch.Generator().manual_seed(m * 1000 + n)
    qweight, scales = make(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    for b in (bias, bias.to(dtype), None):
        got, want = cpu.int4_linear(x, qweight, scales, b), reference_linear(x, qweight, scales, b)
        assert got.dtype == dtype and got.shape == (m, n)
        if dtype == torch.float32:  # fp32 sums in another order than F.linear's
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # both round an fp32 sum once to bf16: at most one bf16 step apart
            torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=2 ** -7)
    whole = cpu.int4_linear(x, qweight, scales, None)
    for i in range(m):  # a row's result does not depend on the rows batched with it
        assert torch.equal(cpu.int4_linear(x[i:i + 1], qweight, scales, None)[0], whole[i])


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17])
def test_float32_scales_holding_fp16_values_give_the_fp16_bits(m):
    # fp16 -> float32 is exact, and both forms run the same tiles: the same bits on every build.
    gen = torch.Generator().manual_seed(40 + m)
    qweight, scales = random_int4(11, 288, gen)
    bias = torch.randn(11, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, 288, generator=gen).to(dtype)
        assert torch.equal(cpu.int4_linear(x, qweight, scales, bias), cpu.int4_linear(x, qweight, scales.float(), bias))


@needs_kernels
def test_int4_linear_takes_strided_rows_and_refuses_bad_shapes():
    gen = torch.Generator().manual_seed(3)
    qweight, scales = random_int4(7, 64, gen)
    x = torch.randn(6, 80, generator=gen)[:, 8:72]  # rows not contiguous with each other
    assert torch.equal(cpu.int4_linear(x, qweight, scales, None),
                       cpu.int4_linear(x.contiguous(), qweight, scales, None))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu.int4_linear(torch.randn(2, 48), qweight, scales, None)
    with pytest.raises(RuntimeError, match="qweight"):
        cpu.int4_linear(torch.randn(2, 32), qweight, scales, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu.int4_linear(x.half(), qweight, scales, None)
    with pytest.raises(RuntimeError, match="scales must be contiguous float16 or float32"):
        cpu.int4_linear(x, qweight, scales.bfloat16(), None)
    assert cpu.int4_linear(torch.randn(0, 64), qweight, scales, None).shape == (0, 7)


def test_quantize_int4_is_round_to_nearest_per_group():
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(5, 96, generator=gen) * torch.arange(1, 6).unsqueeze(1)
    weight[1, 32:64] = 0.25  # a constant group: d = 0, every weight is m
    qweight, scales = quantize_int4(weight)
    assert qweight.shape == (5, 48) and scales.shape == (5, 3, 2) and scales.dtype == torch.float16
    back = reference.int4_dequantize(qweight, scales)  # [5, 96]
    d = scales[..., 0].float().repeat_interleave(32, dim=1)
    group_max = weight.abs().view(5, 3, 32).amax(dim=2).repeat_interleave(32, dim=1)
    assert (back - weight).abs().le(d / 2 + group_max * 2 ** -8).all()  # half a step, plus fp16's d and m
    assert torch.equal(back[1, 32:64], torch.full((32,), 0.25))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 40))
