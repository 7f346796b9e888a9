"""The 4-bit quantizations on CUDA: int4 (quantized at load), GGUF Q4 and AWQ/GPTQ layers served by
the Triton dequant-GEMM (tandem_kernels.int4_matmul), checked on the CPU as far as a machine without
a GPU allows (the method choice, the config checks, packs following the layer's device), and on a
GPU by the GPU-marked engine tests (skipped without CUDA). The kernel's own tests:
tests/test_int4_matmul.py.
"""

from __future__ import annotations

import pytest
import torch
from test_correctness import make_engine, random_prompts, run_engine
import test_int4_checkpoints
from test_linear_methods import dequantized_copy, hf_prompt_logprobs, int4_dequantized

import tandem_kernels.cpu
from backend.models.int4_weights import quantize_int4
from backend.models.linear import LinearMethod, ReplicatedLinear
from backend.models.linear_methods import GPU_QUANTIZATIONS, GgufLinearMethod, Int4LinearMethod, linear_method_for
from backend.models.resolve import resolve_config
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import SamplingParams

CUDA = torch.device("cuda")
checkpoints = test_int4_checkpoints.checkpoints  # the AWQ / GPTQ checkpoints fixture


def test_cuda_gets_the_4bit_methods_without_building_the_cpu_kernels(monkeypatch):
    def no_build():
        raise AssertionError("a CUDA process asked for the C++ CPU kernels")

    monkeypatch.setattr(tandem_kernels.cpu, "available", no_build)
    assert type(linear_method_for(CUDA, torch.bfloat16, "int4")) is Int4LinearMethod
    for quantization in ("gguf", "awq", "gptq"):
        method = linear_method_for(CUDA, torch.float16, quantization)
        assert type(method) is GgufLinearMethod and method.name == quantization
        assert type(method.unpacked) is LinearMethod  # other layers: F.linear on their weight
    assert set(GPU_QUANTIZATIONS) == {"int4", "gguf", "awq", "gptq"}
    for quantization in ("int8", "w8a8"):
        with pytest.raises(ValueError, match=f"quantization='{quantization}' runs on the CPU"):
            linear_method_for(CUDA, torch.bfloat16, quantization)


def test_config_takes_int4_on_cuda_in_half_precision_only(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    model = str(tiny_checkpoint("llama"))
    for dtype in ("auto", "bfloat16", "float16"):
        config = resolve_config(EngineConfig(model=model, quantization="int4", dtype=dtype))
        assert config.device_type == "cuda" and config.torch_dtype_name in ("bfloat16", "float16")
    with pytest.raises(InvalidRequestError, match="int4.*CUDA with bfloat16 or float16; got device cuda, dtype float32"):
        resolve_config(EngineConfig(model=model, quantization="int4", dtype="float32"))
    with pytest.raises(InvalidRequestError, match="quantization='int8'.*activations only; got device cuda") as info:
        resolve_config(EngineConfig(model=model, quantization="int8"))
    assert info.value.param == "quantization"


def meta_layer() -> ReplicatedLinear:
    """A layer whose weight lives on another device than the packs (CPU tensors, as loaded):
    'meta' stands in for CUDA here (nothing is computed)."""
    with torch.device("meta"):
        return ReplicatedLinear(64, 48, bias=False)


def test_packs_move_to_the_layers_device():
    qweight, scales = quantize_int4(torch.randn(48, 64))
    for attr, scale_dtype in (("gguf_int4", torch.float16), ("gguf_int4f", torch.float32)):
        layer = meta_layer()
        setattr(layer, attr, (qweight, scales.to(scale_dtype)))
        GgufLinearMethod(LinearMethod()).process_weights_after_loading(layer)
        held = (layer.int4_weight, layer.int4_scales) if attr == "gguf_int4" else (layer.gguf_codes, layer.gguf_scales)
        assert all(t.device.type == "meta" for t in held) and held[1].dtype == scale_dtype
        assert layer.weight.numel() == 0 and not hasattr(layer, attr)


def test_off_the_cpu_an_int8g_layer_runs_its_loaded_weight():
    """No GPU kernel reads the grouped int8 layout (GGUF Q5_K / Q6_K / Q8_0): the layer keeps the
    dequantized weight loaded from the converted checkpoint, and drops the pack."""
    layer = meta_layer()
    layer.gguf_int8g = (torch.zeros(48, 64, dtype=torch.int8), torch.zeros(48, 4, 2))
    GgufLinearMethod(LinearMethod()).process_weights_after_loading(layer)
    assert not hasattr(layer, "gguf_codes") and not hasattr(layer, "gguf_int8g")
    assert layer.weight.shape == (48, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [("bfloat16", 0.05), ("float16", 0.02)])
def test_cuda_int4_engine_computes_hf_on_the_dequantized_weights(tiny_checkpoint, tmp_path, dtype, tolerance):
    model_dir = tiny_checkpoint("qwen2")  # q, k, v biases: the kernel's bias epilogue
    dequantized = dequantized_copy(model_dir, tmp_path / "dequantized", int4_dequantized)
    engine = make_engine(model_dir, quantization="int4", dtype=dtype, device="cuda", enforce_eager=True)
    linears = [m for m in engine.executor.worker.runner.model.modules() if hasattr(m, "linear_method")]
    assert linears and all(m.int4_weight.is_cuda and m.int4_scales.is_cuda for m in linears)
    prompt = random_prompts([40], 384)[0]
    got = prompt_logprobs(engine, prompt)
    torch.testing.assert_close(got, hf_prompt_logprobs(dequantized, prompt), atol=tolerance, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["awq-g64", "gptq-g32"])  # int4f (fp32 scales) and int4
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_cuda_serves_awq_and_gptq_packed(checkpoints, case, enforce_eager):
    path, _ = checkpoints(case)
    engine = test_int4_checkpoints.engine_for(path, device="cuda", dtype="bfloat16", enforce_eager=enforce_eager)
    packed = [m for m in engine.executor.worker.runner.model.modules()
              if hasattr(m, "gguf_codes") or hasattr(m, "int4_weight")]
    assert packed and all(getattr(m, "gguf_codes", getattr(m, "int4_weight", None)).is_cuda for m in packed)
    prompts = random_prompts([4, 11, 23], 384, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = run_engine(engine, prompts, params)
    assert [len(tokens) for tokens in outputs] == [8, 8, 8]
    engine.shutdown()


def prompt_logprobs(engine, prompt) -> torch.Tensor:
    engine.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    got = next(o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None)
    return torch.tensor([position[token].logprob for position, token in zip(got[1:], prompt[1:])])


def test_an_int4_engine_runs_through_the_triton_kernel_on_the_cpu(tiny_checkpoint, monkeypatch):
    """A rehearsal of the CUDA path's matmuls: every int4 linear of a bf16 engine (qwen2: q, k, v
    biases; the LM head too) sent to the Triton kernel under the interpreter gives the prompt
    logprobs of the C++ kernels, to bf16 rounding."""
    from tandem_kernels import int4_matmul, ops

    model_dir = tiny_checkpoint("qwen2")
    prompt = random_prompts([12], 384)[0]
    want = prompt_logprobs(make_engine(model_dir, quantization="int4", dtype="bfloat16"), prompt)
    calls = []

    def triton_int4(x, qweight, scales, bias):
        calls.append(tuple(qweight.shape))
        return int4_matmul.int4_linear(x, qweight, scales, bias)

    monkeypatch.setattr(ops, "int4_linear", triton_int4)
    got = prompt_logprobs(make_engine(model_dir, quantization="int4", dtype="bfloat16"), prompt)
    assert len(set(calls)) >= 4  # qkv, o, gate_up, down (and the LM head)
    torch.testing.assert_close(got, want, atol=0.02, rtol=0)
