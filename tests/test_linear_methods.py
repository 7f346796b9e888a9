"""Linear methods: oneDNN-prepacked weights (same math as F.linear), weight-only int8 and w8a8."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import transformers as T
from test_correctness import hf_greedy, make_engine, random_prompts, run_engine
from test_kernels_cpu import needs_amx

import tandem_kernels.cpu
import tandem_kernels.reference
from backend.models.linear import LinearMethod, MergedColumnParallelLinear, ReplicatedLinear
from backend.models.int4_weights import quantize_int4
from backend.models.linear_methods import (ONEDNN_CACHE_CAPACITY, AmxLinearMethod, Bf16DotLinearMethod, Int4LinearMethod,
                                           Int8LinearMethod, OneDnnLinearMethod, W8A8LinearMethod, linear_method_for,
                                           quantize_int8)
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import SamplingParams


def layer_with(method, in_features=40, out_features=24, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    layer = ReplicatedLinear(in_features, out_features, bias=True).to(dtype)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    expected_weight, expected_bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.linear_method = method
    method.process_weights_after_loading(layer)
    return layer, expected_weight, expected_bias


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_onednn_method_computes_f_linear(rows):
    layer, weight, bias = layer_with(OneDnnLinearMethod())
    x = torch.randn(rows, 40)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert layer.weight.numel() == 0  # the plain copy was freed


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_amx_method_computes_f_linear(rows):
    layer, weight, bias = layer_with(AmxLinearMethod(), dtype=torch.bfloat16)
    x = torch.randn(rows, 40).bfloat16()
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(layer(x).float(), expected, rtol=2 ** -8, atol=1e-5)  # rounded once to bf16
    assert layer.weight.numel() == 0  # the plain copy was freed


def gate_up_layer(method, half=64, bias=False, dtype=torch.float32):
    """A gate | up layer of 40 inputs, random weights, ``method`` applied; -> (layer, weight, bias)."""
    torch.manual_seed(3)
    layer = MergedColumnParallelLinear(40, [half, half], bias=bias).to(dtype)
    layer.weight.data.normal_(std=40 ** -0.5)
    if bias:
        layer.bias.data.normal_()
    weight = layer.weight.detach().clone()
    bias_copy = layer.bias.detach().clone() if bias else None
    layer.linear_method = method
    method.process_weights_after_loading(layer)
    return layer, weight, bias_copy


def test_forward_gated_is_silu_and_mul_of_forward():
    layer, weight, _ = gate_up_layer(LinearMethod())
    x = torch.randn(6, 40)
    expected = tandem_kernels.reference.silu_and_mul(torch.nn.functional.linear(x, weight))
    torch.testing.assert_close(layer.forward_gated(x), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="equal parts"):
        MergedColumnParallelLinear(40, [32, 64], bias=False).forward_gated(x)


@needs_amx
@pytest.mark.parametrize("half, bias", [(64, False), (48, False), (64, True)])  # fused; 48 and bias: not
def test_amx_method_fuses_silu_into_gate_up_bit_for_bit(half, bias):
    layer, weight, b = gate_up_layer(AmxLinearMethod(), half, bias, torch.bfloat16)
    assert bool(layer.packed_gated_half) == (half % 32 == 0 and not bias)
    x = torch.randn(33, 40).bfloat16()
    plain = layer(x)  # gate | up in the checkpoint's column order, whatever the packing
    expected = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(plain.float(), expected, rtol=2 ** -8, atol=1e-5)
    assert torch.equal(layer.forward_gated(x), tandem_kernels.cpu.silu_and_mul(plain))


ONEDNN_GROWTH_SCRIPT = """
import os, sys, torch
from backend.models.linear import ReplicatedLinear
from backend.models.linear_methods import OneDnnLinearMethod
def rss_mib():
    return next(int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
layer = ReplicatedLinear(256, 512, bias=False)
layer.linear_method = OneDnnLinearMethod()
layer.linear_method.process_weights_after_loading(layer)
layer(torch.randn(3, 256))
before = rss_mib()
for rows in range(1, 301):  # a new row count every call, as under mixed traffic
    layer(torch.randn(rows, 256))
print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"], rss_mib() - before)
"""


def test_onednn_caches_are_bounded_so_changing_batch_sizes_do_not_grow_memory():
    # A fresh process: the bound only takes effect before the process's first oneDNN call.
    # Unbounded (oneDNN's defaults) these 300 row counts grew RSS by 185 MiB here, bounded by 52.
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", ONEDNN_GROWTH_SCRIPT], env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    assert out[:2] == [str(ONEDNN_CACHE_CAPACITY)] * 2
    assert int(out[2]) < 2 * ONEDNN_CACHE_CAPACITY, f"RSS grew {out[2]} MiB over 300 row counts"


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    weight = torch.randn(7, 33) * torch.arange(1, 8).unsqueeze(1)  # rows of different ranges
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.shape == (7,)
    assert q.abs().amax(dim=1).eq(127).all()  # each row uses the full range
    assert ((q.float() * scale.unsqueeze(1) - weight).abs() <= scale.unsqueeze(1) / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 2, 7, 40])
def test_int8_method_computes_the_dequantized_matmul(rows):
    layer, weight, bias = layer_with(Int8LinearMethod())
    q, scale = quantize_int8(weight)
    x = torch.randn(rows, 40)
    expected = torch.nn.functional.linear(x, q.float() * scale.unsqueeze(1), bias)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method_cls", [Int8LinearMethod, W8A8LinearMethod])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_int8_methods_run_in_bf16_and_compute_their_reference(method_cls, rows):
    layer, weight, bias = layer_with(method_cls(), dtype=torch.bfloat16)  # the bias is bf16 too
    q, scale = quantize_int8(weight.float())
    x = torch.randn(rows, 40).bfloat16()
    twin = tandem_kernels.reference.int8_linear if method_cls is Int8LinearMethod else tandem_kernels.reference.w8a8_linear
    got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, twin(x, q, scale, bias), atol=1e-2, rtol=2 ** -7)
    assert layer.weight.numel() == 0  # the plain copy was freed
    packed = method_cls is W8A8LinearMethod or tandem_kernels.cpu.int8_bf16_available()
    if packed:  # one copy of the weight: the packed one
        assert not hasattr(layer, "int8_weight")
        assert (layer.w8a8_packed if method_cls is W8A8LinearMethod else layer.int8_packed) is not None


def test_method_choice():
    cpu = torch.device("cpu")
    assert isinstance(linear_method_for(cpu, torch.float32, None), OneDnnLinearMethod)
    if tandem_kernels.cpu.amx_available():
        bf16 = AmxLinearMethod
    elif tandem_kernels.cpu.bf16_dot_available():  # AVX-512 BF16 without AMX
        bf16 = Bf16DotLinearMethod
    elif torch.ops.mkldnn._is_mkldnn_bf16_supported():
        bf16 = OneDnnLinearMethod
    else:  # an AVX2-only CPU: oneDNN's bf16 reorder refuses the weights
        bf16 = LinearMethod
    assert type(linear_method_for(cpu, torch.bfloat16, None)) is bf16
    assert type(linear_method_for(cpu, torch.float32, "int8")) is Int8LinearMethod
    assert type(linear_method_for(cpu, torch.float32, "w8a8")) is W8A8LinearMethod
    assert type(linear_method_for(cpu, torch.bfloat16, "int8")) is Int8LinearMethod
    assert type(linear_method_for(cpu, torch.bfloat16, "w8a8")) is W8A8LinearMethod
    assert type(linear_method_for(cpu, torch.bfloat16, "int4")) is Int4LinearMethod
    assert type(linear_method_for(torch.device("meta"), torch.float32, None)).__name__ == "LinearMethod"


def test_bad_quantization_settings_are_refused():
    with pytest.raises(InvalidRequestError, match="quantization must be one of int8") as info:
        EngineConfig(quantization="bitsandbytes")
    assert info.value.param == "quantization"


def test_quantization_takes_the_dtype_it_would_have_without_it(tiny_checkpoint):
    from backend.models.resolve import resolve_config
    from backend.types.config import cpu_has_native_bf16

    model = str(tiny_checkpoint("llama"))
    for quantization in ("int8", "w8a8"):
        auto = resolve_config(EngineConfig(model=model, quantization=quantization, device="cpu"))
        assert auto.torch_dtype_name == ("bfloat16" if cpu_has_native_bf16() else "float32")
        for dtype in ("float32", "bfloat16"):
            config = resolve_config(EngineConfig(model=model, quantization=quantization, device="cpu", dtype=dtype))
            assert config.torch_dtype_name == dtype
        with pytest.raises(InvalidRequestError, match="float32 or bfloat16") as info:
            resolve_config(EngineConfig(model=model, quantization=quantization, device="cpu", dtype="float16"))
        assert info.value.param == "quantization"


def int8_dequantized(weight):
    q, scale = quantize_int8(weight.float())
    return q.float() * scale.unsqueeze(1)


def int4_dequantized(weight):
    return tandem_kernels.reference.int4_dequantize(*quantize_int4(weight))


def dequantized_copy(model_dir, out_dir, dequantized=int8_dequantized):
    """The checkpoint with every linear weight (LM head included) replaced by what the quantization
    keeps (``dequantized(weight)``)."""
    model = T.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantized(module.weight.float()))
    model.save_pretrained(str(out_dir))
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out_dir / f.name).write_bytes(f.read_bytes())
    return out_dir


def test_int8_engine_equals_hf_on_the_dequantized_weights(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")  # untied embeddings: the LM head is a linear of its own
    dequantized = dequantized_copy(model_dir, tmp_path / "dequantized")
    prompts = random_prompts([3, 17, 40], 384)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    engine = make_engine(model_dir, quantization="int8")
    assert run_engine(engine, prompts, params) == hf_greedy(dequantized, prompts, 12)
    linears = [m for m in engine.executor.worker.runner.model.modules() if hasattr(m, "linear_method")]
    assert linears and all(m.int8_weight.dtype == torch.int8 for m in linears)  # the LM head too


@pytest.mark.parametrize("quantization, dtype", [("w8a8", "float32"), ("w8a8", "bfloat16"), ("int8", "bfloat16")])
def test_quantized_engine_is_batch_invariant_in_its_dtype(tiny_checkpoint, quantization, dtype):
    engine = make_engine(tiny_checkpoint("qwen2"), quantization=quantization, dtype=dtype)  # qwen2: q, k, v biases
    prompts = random_prompts([3, 17, 40], 384)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    batched = run_engine(engine, prompts, params)
    assert batched == [run_engine(engine, [p], params)[0] for p in prompts]
    runner = engine.executor.worker.runner
    assert all(cache.dtype == getattr(torch, dtype) for kv in runner.kv_caches for cache in kv)
    linears = [m for m in runner.model.modules() if hasattr(m, "weight_scale")]
    method = W8A8LinearMethod if quantization == "w8a8" else Int8LinearMethod
    assert linears and all(type(m.linear_method) is method for m in linears)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_w8a8_method_computes_the_reference(rows, dtype):
    layer, weight, bias = layer_with(W8A8LinearMethod(), in_features=100, out_features=40, dtype=dtype)
    q, scale = quantize_int8(weight.float())
    x = (torch.randn(rows, 100) * 3).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(layer(x), tandem_kernels.reference.w8a8_linear(x, q, scale, bias), **tol)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_int4_method_computes_the_dequantized_matmul(rows):
    layer, weight, bias = layer_with(Int4LinearMethod(), in_features=64)
    x = torch.randn(rows, 64)
    expected = torch.nn.functional.linear(x, int4_dequantized(weight), bias)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    assert layer.weight.numel() == 0 and layer.int4_weight.dtype == torch.uint8


def hf_prompt_logprobs(model_dir, prompt):
    """HF fp32's log-probability of each prompt token after the ones before it (none for the first)."""
    hf = T.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0]  # [len, vocab]
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


# fp32: the same math as HF on the dequantized weights (sums in another order); bf16 activations
# round each op's output to 8 significant bits: the tiny model's logprobs (~-6) moved by up to 0.021.
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_int4_engine_computes_hf_on_the_dequantized_weights_and_is_batch_invariant(
        tiny_checkpoint, tmp_path, dtype, tolerance):
    model_dir = tiny_checkpoint("llama")  # untied embeddings: the LM head is a linear of its own
    dequantized = dequantized_copy(model_dir, tmp_path / "dequantized", int4_dequantized)
    prompts = random_prompts([3, 17, 40], 384)
    engine = make_engine(model_dir, quantization="int4", dtype=dtype)
    linears = [m for m in engine.executor.worker.runner.model.modules() if hasattr(m, "linear_method")]
    assert linears and all(isinstance(m.linear_method, Int4LinearMethod) for m in linears)  # the LM head too
    params = SamplingParams(temperature=0.0, max_tokens=12)
    batched = run_engine(engine, prompts, params)
    assert batched == [run_engine(engine, [p], params)[0] for p in prompts]
    if dtype == "float32":
        assert batched == hf_greedy(dequantized, prompts, 12)
    prompt = prompts[2]
    engine.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    got = next(o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None)
    got = torch.tensor([position[token].logprob for position, token in zip(got[1:], prompt[1:])])
    torch.testing.assert_close(got, hf_prompt_logprobs(dequantized, prompt), atol=tolerance, rtol=0)


def test_int4_refuses_float16_activations(tiny_checkpoint):
    with pytest.raises(InvalidRequestError, match="float32 or bfloat16 activations"):
        make_engine(tiny_checkpoint("llama"), quantization="int4", dtype="float16")


@needs_amx
def test_bf16_engine_on_amx_is_batch_invariant_and_every_linear_uses_it(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("qwen2"), dtype="bfloat16")  # qwen2: q, k, v have biases
    linears = [m for m in engine.executor.worker.runner.model.modules() if hasattr(m, "linear_method")]
    assert linears and all(isinstance(m.linear_method, AmxLinearMethod) for m in linears)  # the LM head too
    prompts = random_prompts([3, 17, 40], 384)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    batched = run_engine(engine, prompts, params)
    assert batched == [run_engine(engine, [p], params)[0] for p in prompts]
