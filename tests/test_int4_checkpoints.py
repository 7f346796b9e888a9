"""quantization="awq" / "gptq": AWQ (GEMM) and GPTQ 4-bit checkpoints served packed on the CPU,
holding exactly the checkpoint's dequantized weights; the packers live in int4_checkpoint_writer.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers as T
from int4_checkpoint_writer import pack_awq, pack_gptq_rows, pack_gptq_zeros, write_int4_checkpoint
from test_correctness import hf_greedy, random_prompts, run_engine

import tandem_kernels.cpu
from backend.engine.llm_engine import LLMEngine
from backend.models.int4_checkpoints import unpack_awq, unpack_gptq
from backend.models.resolve import resolve_config
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import SamplingParams
from conftest import TINY_VOCAB
from tandem_kernels import gguf_reference, reference

pytestmark = pytest.mark.skipif(not tandem_kernels.cpu.available(), reason="needs the fused CPU kernels")

# (method, group_size, sym, arch): AWQ's 64-wide groups as two 32-wide ones; GPTQ symmetric (z = 8:
# fp16 (d, m), the int4 layout) over whole rows, and asymmetric in 32-wide groups (int4f); Qwen2's
# q/k/v biases (plain tensors beside the packed weights) and tied LM head.
CASES = {"awq-g64": ("awq", 64, False, "llama"), "gptq-sym-rows": ("gptq", -1, True, "llama"),
         "gptq-g32": ("gptq", 32, False, "llama"), "awq-qwen2-g32": ("awq", 32, False, "qwen2")}


def word(value: int) -> torch.Tensor:
    return torch.from_numpy(np.array([[value]], dtype=np.uint32).view(np.int32))


def test_awq_unpacks_its_interleaved_column_order():
    # nibble i of the word holds column (0, 2, 4, 6, 1, 3, 5, 7)[i]: nibble values 0..7 land so
    codes, zeros = unpack_awq(word(0x76543210), word(0xFEDCBA98))
    assert codes[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert zeros[:, 0].tolist() == [8, 12, 9, 13, 10, 14, 11, 15]


def test_gptq_unpacks_inputs_along_rows_and_zeros_plus_one():
    codes, zeros = unpack_gptq(word(0xFEDCBA98), word(0x76543210))
    assert codes.tolist() == [[8, 9, 10, 11, 12, 13, 14, 15]]  # one output, inputs 0..7
    assert zeros[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]  # stored z - 1


def test_unpacking_inverts_the_spec_packers():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 24), generator=g, dtype=torch.uint8).numpy()  # [K, N]
    zeros = torch.randint(1, 17, (2, 24), generator=g).numpy()  # [G, N]
    q, z = unpack_awq(torch.from_numpy(pack_awq(codes)), torch.from_numpy(pack_awq(zeros % 16)))
    assert np.array_equal(q.numpy(), codes.T) and np.array_equal(z.numpy(), (zeros % 16).T)
    q, z = unpack_gptq(torch.from_numpy(pack_gptq_rows(codes)), torch.from_numpy(pack_gptq_zeros(zeros)))
    assert np.array_equal(q.numpy(), codes.T) and np.array_equal(z.numpy(), zeros.T)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_128_wide_groups_become_repeated_32_wide_ones_exactly(method):
    from int4_checkpoint_writer import dequantize, quantize

    from backend.models.int4_checkpoints import dequantize_layer, narrowest

    weight = torch.randn(16, 256, generator=torch.Generator().manual_seed(3)) * 0.05  # [N, K]
    codes, zeros, scales = quantize(weight, 128, False, (0, 15) if method == "awq" else (1, 16))
    if method == "awq":
        tensors = {"qweight": pack_awq(codes), "qzeros": pack_awq(zeros.astype(np.uint8))}
    else:
        tensors = {"qweight": pack_gptq_rows(codes), "qzeros": pack_gptq_zeros(zeros)}
    tensors = {name: torch.from_numpy(value) for name, value in tensors.items()} | {"scales": scales}
    qweight, pairs = dequantize_layer(method, "layer", tensors, 128)
    assert torch.equal(gguf_reference.int4f_dequantize(qweight, pairs), dequantize(codes, zeros, scales))
    assert narrowest(qweight, pairs)[0] == "int4f"  # some -s z needs more than fp16's bits
    symmetric = torch.stack([pairs[..., 0], -8 * pairs[..., 0]], dim=2)
    layout, _, half = narrowest(qweight, symmetric)
    assert layout == "int4" and half.dtype == torch.float16 and torch.equal(half.float(), symmetric)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    """case name -> (directory, the dequantized fp32 state dict); the LM head stays fp16."""
    made = {}

    def get(case: str):
        if case not in made:
            method, group, sym, arch = CASES[case]
            out = tmp_path_factory.mktemp(case)
            made[case] = out, write_int4_checkpoint(tiny_checkpoint(arch), out, method, group, sym)
        return made[case]

    return get


def engine_for(path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=256, **kwargs))


def packed_weight(layer) -> torch.Tensor:
    if getattr(layer, "gguf_layout", None) == "int4f":
        return gguf_reference.int4f_dequantize(layer.gguf_codes, layer.gguf_scales)
    return reference.int4_dequantize(layer.int4_weight, layer.int4_scales)


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_layers_hold_the_dequantized_weights_bit_for_bit(checkpoints, case):
    path, model = checkpoints(case)
    engine = engine_for(path, dtype="float32")
    assert engine.config.quantization == CASES[case][0]  # from config.json
    modules = dict(engine.executor.worker.runner.model.named_modules())
    fused = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"], "self_attn.o_proj": ["o_proj"],
             "mlp.gate_up_proj": ["gate_proj", "up_proj"], "mlp.down_proj": ["down_proj"]}
    layouts = set()
    for i in range(2):
        for name, parts in fused.items():
            layer = modules[f"model.layers.{i}.{name}"]
            layouts.add(getattr(layer, "gguf_layout", "int4"))
            prefix = f"model.layers.{i}.{name.split('.')[0]}"
            expected = torch.cat([model[f"{prefix}.{part}.weight"] for part in parts])
            assert torch.equal(packed_weight(layer), expected), name
            assert layer.weight.numel() == 0  # the plain weight was never kept
    assert layouts == ({"int4"} if CASES[case][2] else {"int4f"})  # sym: every m = -8 s is an fp16 value
    engine.shutdown()


@pytest.mark.parametrize("case", ["awq-g64", "gptq-g32", "awq-qwen2-g32"])
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(checkpoints, case, tmp_path):
    path, model = checkpoints(case)
    config = T.AutoConfig.from_pretrained(str(path))
    del config.quantization_config
    hf = T.AutoModelForCausalLM.from_config(config)
    missing, unexpected = hf.load_state_dict(model, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    hf.tie_weights()
    hf.save_pretrained(str(tmp_path), safe_serialization=True)  # fp32, tied head as the checkpoint's
    prompts = random_prompts([3, 9, 17, 30], TINY_VOCAB)
    expected = hf_greedy(tmp_path, prompts, 16)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = engine_for(path, dtype="float32")
    assert run_engine(engine, prompts, params) == expected
    engine.shutdown()


def test_bf16_batched_equals_alone(checkpoints):
    path, _ = checkpoints("awq-g64")
    engine = engine_for(path, dtype="bfloat16")  # the default where the CPU has native bf16
    prompts = random_prompts([4, 11, 23], TINY_VOCAB, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batched = run_engine(engine, prompts, params)
    assert batched == [run_engine(engine, [p], params)[0] for p in prompts]
    engine.shutdown()


@pytest.mark.parametrize("case", ["awq-g64", "gptq-sym-rows"])
def test_int8_activations_take_the_integer_kernel_with_quantization_from_the_checkpoint(checkpoints, case,
                                                                                        monkeypatch):
    path, _ = checkpoints(case)
    calls = []
    kernel = tandem_kernels.cpu.int4_q8_linear
    monkeypatch.setattr(tandem_kernels.cpu, "int4_q8_linear", lambda *a: calls.append(a[0].shape) or kernel(*a))
    monkeypatch.setattr(tandem_kernels.cpu, "int4_linear", lambda *a: pytest.fail("the exact kernel ran"))
    engine = engine_for(path, dtype="float32", int4_activations="int8", enforce_eager=True)  # no quantization=
    assert engine.config.quantization == CASES[case][0]
    prompts = random_prompts([4, 11, 23], TINY_VOCAB, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batched = run_engine(engine, prompts, params)
    assert calls and all(len(out) == 12 for out in batched)
    assert batched == [run_engine(engine, [p], params)[0] for p in prompts]
    engine.shutdown()


def edited(path, tmp_path, **changes):
    """A copy of checkpoint ``path`` with quantization_config keys changed."""
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] |= changes
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("changes, message", [
    (dict(desc_act=True), "desc_act=true"), (dict(bits=8), "bits=8"), (dict(group_size=48), "group_size=48"),
    (dict(quant_method="bitsandbytes"), "quant_method='bitsandbytes'"),
    (dict(checkpoint_format="gptq_v2"), "checkpoint_format='gptq_v2'")])
def test_unsupported_gptq_options_are_refused_by_name(checkpoints, tmp_path, changes, message):
    path, _ = checkpoints("gptq-g32")
    with pytest.raises(InvalidRequestError, match=message):
        resolve_config(EngineConfig(model=str(edited(path, tmp_path, **changes))))


@pytest.mark.parametrize("changes, message", [
    (dict(version="gemv"), "version='gemv'"), (dict(zero_point=False), "zero_point=false")])
def test_unsupported_awq_options_are_refused_by_name(checkpoints, tmp_path, changes, message):
    path, _ = checkpoints("awq-g64")
    with pytest.raises(InvalidRequestError, match=message):
        resolve_config(EngineConfig(model=str(edited(path, tmp_path, **changes))))


def test_an_act_order_g_idx_is_refused_by_name(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = checkpoints("gptq-g32")
    out = edited(path, tmp_path)
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name} is not k // group_size"):
        engine_for(out, dtype="float32")


def test_a_mismatching_quantization_is_refused(checkpoints, tiny_checkpoint):
    path, _ = checkpoints("awq-g64")
    with pytest.raises(InvalidRequestError, match="holds AWQ 4-bit weights.*quantization='int4' does not apply"):
        resolve_config(EngineConfig(model=str(path), quantization="int4"))
    with pytest.raises(InvalidRequestError, match="holds AWQ"):
        resolve_config(EngineConfig(model=str(path), quantization="gptq"))
    with pytest.raises(InvalidRequestError, match="no quantization_config"):
        resolve_config(EngineConfig(model=str(tiny_checkpoint("llama")), quantization="awq"))
    with pytest.raises(InvalidRequestError, match="quantization='awq' runs on one worker"):
        resolve_config(EngineConfig(model=str(path), tensor_parallel_size=2))


def test_cuda_takes_awq_in_half_precision_only(checkpoints, monkeypatch):
    """On CUDA the Triton int4 kernel serves AWQ with bf16 / fp16 activations; fp32 is refused by name."""
    path, _ = checkpoints("awq-g64")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = resolve_config(EngineConfig(model=str(path)))
    assert (config.quantization, config.device_type, config.torch_dtype_name) == ("awq", "cuda", "bfloat16")
    with pytest.raises(InvalidRequestError, match="quantization='awq'.*CUDA with bfloat16 or float16.*float32"):
        resolve_config(EngineConfig(model=str(path), dtype="float32"))


def test_a_plain_layer_beside_packed_ones_runs_its_weight(tiny_checkpoint, tmp_path):
    # AWQ's modules_to_not_convert: the layer is stored as a plain fp16 weight
    model = write_int4_checkpoint(tiny_checkpoint("llama"), tmp_path / "c", "awq", 32, skip=("layers.1.mlp.down_proj",))
    engine = engine_for(tmp_path / "c", dtype="float32")
    modules = dict(engine.executor.worker.runner.model.named_modules())
    assert hasattr(modules["model.layers.0.mlp.down_proj"], "gguf_codes")
    plain = modules["model.layers.1.mlp.down_proj"]
    assert not hasattr(plain, "gguf_codes") and not hasattr(plain, "int4_weight")
    x = torch.randn(3, plain.input_size)
    torch.testing.assert_close(plain(x), x @ model["model.layers.1.mlp.down_proj.weight"].t())
    engine.shutdown()


def test_a_fused_layer_with_a_plain_part_is_refused(tiny_checkpoint, tmp_path):
    write_int4_checkpoint(tiny_checkpoint("llama"), tmp_path / "c", "gptq", 32, skip=("layers.0.self_attn.k_proj",))
    with pytest.raises(ValueError, match="qkv_proj is fused from parts of which only .*q_proj.*v_proj are quantized"):
        engine_for(tmp_path / "c", dtype="float32")
