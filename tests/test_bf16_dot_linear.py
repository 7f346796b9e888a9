"""The bf16 linear on AVX-512 BF16 dot products (kernels/tandem_kernels/csrc/bf16_linear.cpp) and its
linear method: the exact matmul rounded once to bf16, batch-invariant, and an engine that runs it
greedy-decodes the tokens of the same engine on oneDNN's bf16 matmul."""

from __future__ import annotations

import pytest
import torch
from test_correctness import make_engine, random_prompts, run_engine

import tandem_kernels.cpu as cpu
from backend.models.linear_methods import Bf16DotLinearMethod, OneDnnLinearMethod, linear_method_for
from backend.types.sampling_params import SamplingParams

needs_bf16_dot = pytest.mark.skipif(not cpu.bf16_dot_available() or cpu.amx_available(),
                                    reason="needs a CPU with AVX-512 BF16 and no AMX (AMX runs amx_linear)")


def exact_close(got: torch.Tensor, exact: torch.Tensor) -> None:
    # bf16 keeps 8 significant bits: rounding once is within half a unit, 2^-8 relative; the
    # fp32 sums (in another order than F.linear's) add ~1e-6.
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-5)


@needs_bf16_dot
# Pads in K (odd), N (not a multiple of 16), blocks of 1-4 panels, 1-3 leftover rows after 4-row tiles.
@pytest.mark.parametrize("m, k, n", [(1, 64, 32), (5, 70, 33), (33, 576, 100), (70, 41, 300), (2, 7, 5), (7, 1536, 64)])
def test_bf16_dot_linear_is_the_exact_sum_rounded_once_to_bf16(m, k, n):
    gen = torch.Generator().manual_seed(7)
    x, weight, bias = (torch.randn(shape, generator=gen).bfloat16() for shape in ((m, k), (n, k), (n,)))
    packed = cpu.bf16_pack_weight(weight)
    for b in (bias, bias.float(), None):
        exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        got = cpu.bf16_dot_linear(x, packed, n, b)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        exact_close(got, exact)
    whole = cpu.bf16_dot_linear(x, packed, n, bias)
    for i in range(m):  # a row's result does not depend on the rows batched with it
        assert torch.equal(cpu.bf16_dot_linear(x[i:i + 1], packed, n, bias)[0], whole[i])
    strided = torch.randn(m, k + 8, generator=gen).bfloat16()[:, 3:k + 3]  # rows not contiguous
    assert torch.equal(cpu.bf16_dot_linear(strided, packed, n, None),
                       cpu.bf16_dot_linear(strided.contiguous(), packed, n, None))


@needs_bf16_dot
def test_bf16_dot_linear_refuses_a_weight_of_another_shape():
    packed = cpu.bf16_pack_weight(torch.randn(40, 64).bfloat16())
    with pytest.raises(RuntimeError, match="bf16_pack_weight of"):
        cpu.bf16_dot_linear(torch.randn(2, 96).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="bf16_pack_weight of"):
        cpu.bf16_dot_linear(torch.randn(2, 64).bfloat16(), packed, 80, None)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        cpu.bf16_dot_linear(torch.randn(2, 64), packed, 40, None)
    assert cpu.bf16_dot_linear(torch.randn(0, 64).bfloat16(), packed, 40, None).shape == (0, 40)


@needs_bf16_dot
@pytest.mark.parametrize("m, k, d", [(1, 40, 32), (5, 64, 64), (33, 71, 96)])  # 4-row tiles and leftovers, odd K
def test_bf16_dot_gated_linear_is_silu_and_mul_of_bf16_dot_linear_bit_for_bit(m, k, d):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=gen).bfloat16()
    weight = (torch.randn(2 * d, k, generator=gen) * k ** -0.5).bfloat16()
    expected = cpu.silu_and_mul(cpu.bf16_dot_linear(x, cpu.bf16_pack_weight(weight), 2 * d, None))
    got = cpu.bf16_dot_gated_linear(x, cpu.bf16_pack_weight(weight[cpu.amx_gated_order(d)]), d)
    assert got.shape == (m, d) and torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="gate | up weight"):
        cpu.bf16_dot_gated_linear(x, cpu.bf16_pack_weight(weight), d + 16)


@needs_bf16_dot
@pytest.mark.parametrize("half, bias", [(64, False), (48, False), (64, True)])  # fused; 48 and bias: not
def test_bf16_dot_method_fuses_silu_into_gate_up_bit_for_bit(half, bias):
    from test_linear_methods import gate_up_layer

    layer, weight, b = gate_up_layer(Bf16DotLinearMethod(), half, bias, torch.bfloat16)
    assert bool(layer.packed_gated_half) == (half % 32 == 0 and not bias)
    x = torch.randn(33, 40).bfloat16()
    plain = layer(x)  # gate | up in the checkpoint's column order, whatever the packing
    exact_close(plain, torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double()))
    assert torch.equal(layer.forward_gated(x), cpu.silu_and_mul(plain))


@needs_bf16_dot
@pytest.mark.parametrize("shape", [(1, 40), (5, 40), (2, 3, 40)])
def test_bf16_dot_method_computes_f_linear(shape):
    from test_linear_methods import layer_with

    assert type(linear_method_for(torch.device("cpu"), torch.bfloat16, None)) is Bf16DotLinearMethod
    layer, weight, bias = layer_with(Bf16DotLinearMethod(), dtype=torch.bfloat16)
    x = torch.randn(shape).bfloat16()
    got = layer(x)
    assert got.shape == (*shape[:-1], 24)
    exact_close(got, torch.nn.functional.linear(x.double(), weight.double(), bias.double()))
    assert layer.weight.numel() == 0  # the plain copy was freed


@needs_bf16_dot
def test_bf16_engine_decodes_onednns_tokens_and_is_batch_invariant(tiny_checkpoint, monkeypatch):
    prompts = random_prompts([3, 17, 40], 384)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    model_dir = tiny_checkpoint("qwen2")  # qwen2: q, k, v have biases
    engine = make_engine(model_dir, dtype="bfloat16")
    linears = [m for m in engine.executor.worker.runner.model.modules() if hasattr(m, "linear_method")]
    assert linears and all(type(m.linear_method) is Bf16DotLinearMethod for m in linears)  # the LM head too
    batched = run_engine(engine, prompts, params)
    assert batched == [run_engine(engine, [p], params)[0] for p in prompts]
    del engine

    monkeypatch.setattr(cpu, "bf16_dot_available", lambda: False)  # the method chosen before this kernel
    onednn = make_engine(model_dir, dtype="bfloat16")
    assert all(type(m.linear_method) is OneDnnLinearMethod
               for m in onednn.executor.worker.runner.model.modules() if hasattr(m, "linear_method"))
    assert run_engine(onednn, prompts, params) == batched
