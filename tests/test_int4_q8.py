"""int8 activations for the 4-bit CPU matmuls (``int4_activations="int8"``, csrc/int4_q8.cpp):
the kernel against its plain-torch contract (gguf_reference.int4_q8_linear), its batch
invariance, how far it lands from the exact matmul, and the engine option end to end."""

from __future__ import annotations

import pytest
import torch
from test_correctness import random_prompts, run_engine
from test_gguf_packed import gguf_engine, tensor_type
from test_loader import TINY_VOCAB, write_tiny_llama_gguf

import tandem_kernels.cpu
from backend.models.int4_weights import quantize_int4
from backend.models.linear_methods import linear_method_for
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import SamplingParams
from tandem_kernels import gguf_reference as G

needs_kernels = pytest.mark.skipif(not tandem_kernels.cpu.available(), reason="needs the fused CPU kernels")


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    """test_gguf_packed's tiny Llama: Q4_0 attention, Q4_1 MLP and head, one fp32 layer."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4.gguf"
    write_tiny_llama_gguf(path, tensor_type, untied=True)
    return path


def weights(n: int, k: int, float_scales: bool, seed: int = 0):
    torch.manual_seed(seed)
    qweight, scales = quantize_int4(torch.randn(n, k) * 0.02)  # [N, K / 2] uint8, [N, K / 32, 2] fp16
    return qweight, (scales.float() if float_scales else scales)


def q8_kernel(x, qweight, scales, bias):
    """The kernel on the int4 layout's weights, packed as it reads them."""
    return tandem_kernels.cpu.int4_q8_linear(x, *G.pack_int4_q8(qweight, scales), qweight.shape[0], bias)


@pytest.mark.parametrize("float_scales", [False, True], ids=["fp16-scales", "fp32-scales"])
def test_panels_interleave_8_columns_and_unpack_exactly(float_scales):
    n, k = 13, 64  # two panels, the second padded with 3 zero columns
    qweight, scales = weights(n, k, float_scales)
    codes, dm = G.pack_int4_q8(qweight, scales)
    assert codes.shape == (2, k // 8, 32) and dm.shape == (2, k // 32, 2, 8) and dm.dtype == scales.dtype
    halves = qweight.view(n, -1, 16)
    code = torch.cat([halves & 15, halves >> 4], dim=2).view(n, k)  # [N, K]: the int4 layout's codes
    for col, kk in [(0, 0), (5, 13), (8, 37), (12, 63)]:
        p, j, c, b = col // 8, col % 8, kk // 8, kk % 8
        byte = int(codes[p, c, 4 * j + b % 4])
        assert (byte >> 4 if b >= 4 else byte & 15) == int(code[col, kk]), (col, kk)
        assert dm[p, kk // 32, 0, j] == scales[col, kk // 32, 0] and dm[p, kk // 32, 1, j] == scales[col, kk // 32, 1]
    assert not codes[1, :, 20:].any() and not dm[1, :, :, 5:].any()  # columns 13..15: zero codes and scales
    back = G.unpack_int4_q8(codes, dm, n)
    assert torch.equal(back[0], qweight) and torch.equal(back[1], scales)


def test_quantize_q8_groups_rounds_each_group_to_its_own_scale():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2.0, 1.0, 32)
    x[1, 32:] = 0.5  # row 1's first group is all zero
    q, s = G.quantize_q8_groups(x)
    assert s[0, 0] == pytest.approx(2.0 / 127) and s[0, 1] == 0 and s[1, 0] == 0
    assert q[0, 0] == -127 and q[1, 32] == 127 and not q[1, :32].any()
    assert (q.float() * s.repeat_interleave(32, dim=1) - x).abs().max() <= 1.0 / 127  # at most half a step
    ties = torch.tensor([[127.0, 4.5, 5.5, -2.5] + [0.0] * 28])  # a step of 1: ties round to even
    assert G.quantize_q8_groups(ties)[0][0, :4].tolist() == [127, 4, 6, -2]


@needs_kernels
@pytest.mark.parametrize("float_scales", [False, True], ids=["fp16-scales", "fp32-scales"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,m", [(64, 256, 1), (37, 512, 2), (70, 1024, 9), (16, 256, 11), (16, 256, 12),
                                   (16, 256, 15), (21, 1024, 133)])
def test_kernel_meets_its_reference(n, k, m, dtype, float_scales):
    qweight, scales = weights(n, k, float_scales)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n)
    got, ref = q8_kernel(x, qweight, scales, bias), G.int4_q8_linear(x, qweight, scales, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    if dtype == torch.float32:  # fp32 sums against float64's: rounding only
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:  # and one bf16 rounding of the result
        torch.testing.assert_close(got.float(), ref.float(), rtol=8e-3, atol=1e-2)
    # A row's result does not depend on the rows beside it: tiles of 8 rows with AVX-512 VNNI, else 4,
    # and every shorter tail; blocks of 128 rows at K = 1024.
    for row in range(m):
        alone = q8_kernel(x[row:row + 1].contiguous(), qweight, scales, bias)
        assert torch.equal(alone, got[row:row + 1]), row


@needs_kernels
@pytest.mark.parametrize("float_scales", [False, True], ids=["fp16-scales", "fp32-scales"])
def test_a_columns_result_does_not_depend_on_the_panels_beside_it(float_scales):
    """With AVX-512 VNNI two adjacent panels (16 columns) share one 512-bit tile, an odd last panel
    runs alone: a column gives the same bits in a pair, alone, and as the odd panel."""
    qweight, scales = weights(24, 512, float_scales)
    x = torch.randn(9, 512).to(torch.bfloat16)
    whole = q8_kernel(x, qweight, scales, None)  # panels 0 and 1 paired, panel 2 alone
    for lo, hi in [(0, 8), (8, 16), (16, 24), (8, 24)]:  # alone, alone, alone, paired
        part = q8_kernel(x, qweight[lo:hi].contiguous(), scales[lo:hi].contiguous(), None)
        assert torch.equal(part, whole[:, lo:hi]), (lo, hi)


@needs_kernels
def test_kernel_rounds_ties_to_even_and_passes_a_nan_on():
    qweight, scales = weights(8, 64, float_scales=False)
    x = torch.zeros(2, 64)
    x[0, :4] = torch.tensor([127.0, 4.5, 5.5, -2.5])  # a step of 1: 4, 6, -2 (half away from zero: 5, 6, -3)
    x[0, 32:] = torch.randn(32)
    x[1, 3] = float("nan")  # one NaN in row 1's first group
    got = q8_kernel(x, qweight, scales, None)
    ref = G.int4_q8_linear(x, qweight, scales, None)
    torch.testing.assert_close(got[:1], ref[:1], rtol=1e-6, atol=1e-6)
    assert got[1].isnan().all() and ref[1].isnan().all()
    away = x[:1].clone()
    away[0, 1:4] = torch.tensor([5.0, 6.0, -3.0])  # what half away from zero would give
    assert not torch.equal(got[:1], G.int4_q8_linear(away, qweight, scales, None))


@needs_kernels
def test_zero_activations_give_the_bias_and_the_error_against_the_exact_matmul_is_small():
    qweight, scales = weights(96, 2048, float_scales=True, seed=1)
    bias = torch.randn(96)
    assert torch.equal(q8_kernel(torch.zeros(3, 2048), qweight, scales, bias),
                       bias.expand(3, 96))
    x = torch.randn(4, 2048)
    exact = tandem_kernels.cpu.int4_linear(x, qweight, scales, None)
    approx = q8_kernel(x, qweight, scales, None)
    assert not torch.equal(approx, exact)  # the activations were rounded
    assert ((approx - exact).norm() / exact.norm()).item() < 0.01  # ~0.5% for Gaussian x


def test_the_option_is_refused_where_it_does_not_apply(q4_gguf):
    with pytest.raises(InvalidRequestError, match="int4_activations must be one of exact, int8"):
        EngineConfig(int4_activations="int4")
    with pytest.raises(InvalidRequestError, match="4-bit weights on the CPU") as refused:
        gguf_engine(q4_gguf, dtype="float32", int4_activations="int8")  # no quantization: nothing 4-bit
    assert refused.value.param == "int4_activations"
    with pytest.raises(ValueError, match="4-bit weights on the CPU"):
        linear_method_for(torch.device("cpu"), torch.float32, "int8", "int8")


@needs_kernels
def test_a_gguf_file_without_4bit_layers_refuses_int8_activations(tmp_path):
    path = tmp_path / "tiny-q8.gguf"
    write_tiny_llama_gguf(path, lambda name: None if "norm" in name else "Q8_0", untied=True)
    with pytest.raises(InvalidRequestError, match="has none") as refused:
        gguf_engine(path, quantization="gguf", dtype="float32", int4_activations="int8")
    assert refused.value.param == "int4_activations"
    gguf_engine(path, quantization="gguf", dtype="float32")  # exact: served


@needs_kernels
def test_gguf_with_int8_activations_runs_the_integer_kernel_batched_as_alone(q4_gguf, monkeypatch):
    prompts = random_prompts([3, 17, 40], TINY_VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    calls = []
    kernel = tandem_kernels.cpu.int4_q8_linear
    monkeypatch.setattr(tandem_kernels.cpu, "int4_q8_linear", lambda *a: calls.append(a[0].shape) or kernel(*a))
    monkeypatch.setattr(tandem_kernels.cpu, "int4_linear", lambda *a: pytest.fail("the exact kernel ran"))
    engine = gguf_engine(q4_gguf, quantization="gguf", dtype="float32", int4_activations="int8",
                         enforce_eager=True)
    batched = run_engine(engine, prompts, params)
    assert calls and all(len(out) == 12 for out in batched)
    assert batched == [run_engine(engine, [p], params)[0] for p in prompts]
    calls.clear()  # the default, CPU decode graphs: traced with the op, replayed
    assert run_engine(gguf_engine(q4_gguf, quantization="gguf", dtype="float32", int4_activations="int8"),
                      prompts, params) == batched
    assert calls


@needs_kernels
def test_q4_k_layers_keep_fp16_scales_under_int8_activations(tmp_path):
    from test_gguf_blocks import engine_for, write_mixed_gguf

    mixed = write_mixed_gguf(tmp_path / "tiny-mixed.gguf")  # layer 1's gate_up: Q4_K | Q4_0, the int4f layout
    exact = dict(engine_for(mixed, quantization="gguf", dtype="float32").executor.worker.runner.model.named_modules())
    int8 = engine_for(mixed, quantization="gguf", dtype="float32", int4_activations="int8")
    modules = dict(int8.executor.worker.runner.model.named_modules())
    name = "model.layers.1.mlp.gate_up_proj"
    codes, dm, n = modules[name].int4_q8_panels  # the integer kernel's panels, fp16 scales
    assert dm.dtype == torch.float16 and exact[name].gguf_scales.dtype == torch.float32
    qweight, scales = G.unpack_int4_q8(codes, dm, n)
    assert torch.equal(qweight, exact[name].gguf_codes)
    torch.testing.assert_close(scales.float(), exact[name].gguf_scales, rtol=1e-3, atol=1e-7)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [len(out) for out in run_engine(int8, random_prompts([5, 11], 128), params)] == [8, 8]
