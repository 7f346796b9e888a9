"""quantization="gguf": a GGUF file's Q4_0 / Q4_1 linear weights served packed by the int4 kernel,
the rest dequantized; the same model as the file's dequantized conversion."""

from __future__ import annotations

import pytest
import torch
from test_correctness import random_prompts, run_engine
from test_loader import TINY_VOCAB, write_tiny_llama_gguf

import tandem_kernels.cpu
from backend.engine.llm_engine import LLMEngine
from backend.models.gguf_packed import pack_replaces_weight, unpermute_rows
from backend.models.linear import ReplicatedLinear
from backend.models.loader import iter_weights
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.sampling_params import SamplingParams
from tandem_kernels import reference

pytestmark = pytest.mark.skipif(not tandem_kernels.cpu.available(), reason="needs the fused CPU kernels")


def tensor_type(name: str):
    """Attention Q4_0, MLP and LM head Q4_1; one layer's ffn_down, the embedding and norms fp32."""
    if name == "blk.1.ffn_down.weight" or "norm" in name:
        return None
    if "attn_" in name:
        return "Q4_0"
    if "ffn_" in name or name == "output.weight":
        return "Q4_1"
    return None


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4.gguf"
    write_tiny_llama_gguf(path, tensor_type, untied=True)
    return path


def gguf_engine(gguf_file, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(gguf_file), download_dir=str(gguf_file.parent / "cache"), block_size=4,
                                  num_kv_blocks=256, **kwargs))


def test_unpermute_rows_undoes_llama_cpp_rotary_interleave():
    # llama.cpp stores row (h, d, half) of HF's (h, half, d): 2 heads of 2 x 3 rows
    stored = torch.arange(12).view(2, 2, 3).transpose(1, 2).reshape(-1)  # HF row numbers in stored order
    assert torch.equal(stored[unpermute_rows(12, 2)], torch.arange(12))


def test_q4_layers_stay_packed_and_hold_the_converted_values_exactly(q4_gguf):
    engine = gguf_engine(q4_gguf, quantization="gguf", dtype="float32")
    modules = dict(engine.executor.worker.runner.model.named_modules())
    converted = dict(iter_weights(engine.config.model_path))
    expected = {"model.layers.0.self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"],
                "model.layers.1.mlp.gate_up_proj": ["gate_proj", "up_proj"],
                "model.layers.0.mlp.down_proj": ["down_proj"], "model.layers.1.self_attn.o_proj": ["o_proj"]}
    for name, parts in expected.items():
        layer = modules[name]
        prefix = name.rsplit(".", 1)[0]
        weight = torch.cat([converted[f"{prefix}.{part}.weight"] for part in parts])
        assert torch.equal(reference.int4_dequantize(layer.int4_weight, layer.int4_scales), weight), name
    assert torch.equal(reference.int4_dequantize(modules["lm_head"].int4_weight, modules["lm_head"].int4_scales),
                       converted["lm_head.weight"])
    assert not hasattr(modules["model.layers.1.mlp.down_proj"], "int4_weight")  # fp32 in the file: unpacked


def test_packed_gguf_generates_the_dequantized_models_greedy_tokens(q4_gguf):
    prompts = random_prompts([3, 17, 40], TINY_VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    dequantized = run_engine(gguf_engine(q4_gguf, dtype="float32"), prompts, params)
    assert run_engine(gguf_engine(q4_gguf, quantization="gguf", dtype="float32"), prompts, params) == dequantized
    bf16 = gguf_engine(q4_gguf, quantization="gguf")  # bf16 activations by default where the CPU has them
    batched = run_engine(bf16, prompts, params)
    assert batched == [run_engine(bf16, [p], params)[0] for p in prompts]


def test_the_packed_layers_dequantized_weights_are_never_loaded(q4_gguf, monkeypatch):
    """A packed layer runs from its pack alone: its converted fp32 tensors are skipped unread (here
    each is swapped for an empty tensor, which any copy would refuse), the others load as before."""
    import backend.worker.model_runner as model_runner

    unpacked = "model.layers.1.mlp.down_proj.weight"  # fp32 in the file
    packed_parts = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
    swapped = []

    def emptied(model_path):
        for name, tensor in iter_weights(model_path):
            if name != unpacked and any(f"{part}.weight" in name for part in packed_parts):
                swapped.append(name)
                tensor = torch.empty(0)
            yield name, tensor

    prompts = random_prompts([3, 17], TINY_VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    dequantized = run_engine(gguf_engine(q4_gguf, dtype="float32"), prompts, params)
    monkeypatch.setattr(model_runner, "iter_weights", emptied)
    engine = gguf_engine(q4_gguf, quantization="gguf", dtype="float32")
    assert len(swapped) == 2 * 7 - 1 + 1  # 2 layers' q, k, v, o, gate, up, down but one, and the head
    modules = dict(engine.executor.worker.runner.model.named_modules())
    assert modules["model.layers.0.mlp.gate_up_proj"].weight_is_packed
    assert not getattr(modules["model.layers.1.mlp.down_proj"], "weight_is_packed", False)
    assert run_engine(engine, prompts, params) == dequantized


def test_a_pack_replaces_the_weight_unless_shared_or_int8g_off_the_cpu():
    """What ``GgufLinearMethod`` runs without the loaded weight, so the load may skip it."""
    cpu = ReplicatedLinear(64, 48, bias=False)
    with torch.device("meta"):  # any device but the CPU: int8g has no kernel there
        elsewhere = ReplicatedLinear(64, 48, bias=False)
    assert all(pack_replaces_weight(cpu, layout) for layout in ("int4", "int4f", "int8g"))
    assert pack_replaces_weight(elsewhere, "int4") and pack_replaces_weight(elsewhere, "int4f")
    assert not pack_replaces_weight(elsewhere, "int8g")
    cpu.weight_is_shared = True  # a tied LM head: the embedding's weight
    assert not pack_replaces_weight(cpu, "int4")


def test_gguf_quantization_needs_a_gguf_file(tiny_checkpoint):
    with pytest.raises(InvalidRequestError, match="not one"):
        LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), quantization="gguf"))
