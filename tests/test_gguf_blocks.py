"""GGUF's Q8_0 / Q4_K / Q5_K / Q6_K blocks (and Q4_0 / Q4_1) decoded into the grouped int8 layout
exactly, against the ``gguf`` package's dequantize; the grouped kernel against its reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import kquant_blocks
from kquant_blocks import random_blocks

from backend.models.gguf_blocks import int4f_from_gguf, int8g_from_gguf
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


def test_q4_k_fits_four_bit_codes_with_fp32_scales():
    shape = (3, 512)
    raw = random_blocks("Q4_K", *shape, seed=7)
    qweight, scales = int4f_from_gguf(raw, "Q4_K", shape)
    assert qweight.shape == (3, 256) and scales.shape == (3, 16, 2)
    assert torch.equal(gguf_reference.int4f_dequantize(qweight, scales), oracle(raw, "Q4_K", shape))


@pytest.mark.parametrize("layout", ["int8g", "int4f"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_grouped_kernels_match_their_references(layout, dtype, rows):
    import tandem_kernels.cpu

    if not tandem_kernels.cpu.available():
        pytest.skip("needs the fused CPU kernels")
    shape = (21, 512)  # N not a multiple of the kernel's 8-row panels
    decode = int8g_from_gguf if layout == "int8g" else int4f_from_gguf
    codes, scales = decode(random_blocks("Q4_K", *shape, seed=3), "Q4_K", shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(shape[0])
    # int4f (4-bit codes, float32 scales) runs int4_linear's tiles, int8g its own kernel
    kernel = tandem_kernels.cpu.gguf_int8g_linear if layout == "int8g" else tandem_kernels.cpu.int4_linear
    got = kernel(x, codes, scales, bias)
    want = getattr(gguf_reference, f"{layout}_linear")(x, codes, scales, bias)
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    for row in {0, rows // 2, rows - 1}:  # batch-invariant: a row's sums never depend on M (or its tile)
        assert torch.equal(kernel(x[row:row + 1], codes, scales, bias)[0], got[row])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8g_kernel_is_batch_invariant_whatever_its_scales(dtype):
    """Rows alone (decode, weights dequantized in registers) and batched (dequantized panels, tiles
    of up to 4 x 4 sums) give the same bits, even for float32 scales whose products with the codes
    are not exact, where a fused and an unfused dequantization differ."""
    import tandem_kernels.cpu

    if not tandem_kernels.cpu.available():
        pytest.skip("needs the fused CPU kernels")
    g = torch.Generator().manual_seed(1)
    n, k = 40, 1024
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    scales = torch.stack([torch.rand(n, k // 16, generator=g) * 0.01 + 1e-3,
                          -torch.rand(n, k // 16, generator=g) * 0.05], dim=2)  # 24-bit significands
    x = torch.randn(9, k, generator=g).to(dtype)
    batched = tandem_kernels.cpu.gguf_int8g_linear(x, codes, scales, None)
    for row in range(9):
        assert torch.equal(tandem_kernels.cpu.gguf_int8g_linear(x[row:row + 1], codes, scales, None)[0], batched[row])


# --- a tiny Llama GGUF of mixed types, served packed ----------------------------------------------

HIDDEN, FFN = 256, 512  # K-quant rows are whole 256-weight super-blocks


def mixed_type(name: str):
    """A fused qkv of three types, gate_up of two, every served type somewhere; norms and the
    embedding fp32."""
    if "norm" in name or name == "token_embd.weight":
        return None
    kinds = {"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q8_0", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
             "ffn_up": "Q5_K", "ffn_down": "Q6_K", "output": "Q6_K"}
    if name == "blk.1.ffn_down.weight":
        return "Q4_1"
    if name == "blk.1.ffn_up.weight":  # layer 1's gate_up: Q4_K | Q4_0, 4-bit codes with fp32 scales
        return "Q4_0"
    if name.startswith("blk.1.attn_output"):
        return "Q4_0"
    return kinds[name.split(".")[-2]]


def write_mixed_gguf(path, types=mixed_type):
    from test_loader import write_tiny_llama_gguf

    seeds = iter(range(1000))

    def blocks(kind, shape):
        if kind == "Q2_K":
            return kquant_blocks.q2_k_blocks(*shape, seed=next(seeds))
        if kind in kquant_blocks.BLOCK_BYTES:
            return random_blocks(kind, *shape, seed=next(seeds))
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        rng = np.random.default_rng(next(seeds))
        return gguf.quants.quantize((rng.standard_normal(shape) * 0.05).astype(np.float32), qtype)

    write_tiny_llama_gguf(path, types, untied=True, hidden=HIDDEN, ffn=FFN, raw_blocks=blocks)
    return path


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    return write_mixed_gguf(tmp_path_factory.mktemp("kquant") / "tiny-mixed.gguf")


def engine_for(gguf_file, **kwargs):
    from backend.engine.llm_engine import LLMEngine
    from backend.types.config import EngineConfig

    return LLMEngine(EngineConfig(model=str(gguf_file), download_dir=str(gguf_file.parent / "cache"), block_size=4,
                                  num_kv_blocks=512, **kwargs))


def test_mixed_kquant_gguf_is_served_packed_with_the_dequantized_models_greedy_tokens(mixed_gguf):
    import tandem_kernels.cpu
    from backend.types.sampling_params import SamplingParams
    from test_correctness import random_prompts, run_engine

    if not tandem_kernels.cpu.available():
        pytest.skip("needs the fused CPU kernels")
    from backend.models.loader import iter_weights

    packed = engine_for(mixed_gguf, quantization="gguf", dtype="float32")
    modules = dict(packed.executor.worker.runner.model.named_modules())
    converted = dict(iter_weights(packed.config.model_path))
    qkv = modules["model.layers.0.self_attn.qkv_proj"]  # Q4_K | Q6_K | Q8_0 rows
    want = torch.cat([converted[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert qkv.gguf_layout == "int8g"
    assert torch.equal(gguf_reference.int8g_dequantize(qkv.gguf_codes, qkv.gguf_scales), want)
    gate_up = modules["model.layers.1.mlp.gate_up_proj"]  # Q4_K | Q4_0 rows
    want = torch.cat([converted[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert gate_up.gguf_layout == "int4f"
    assert torch.equal(gguf_reference.int4f_dequantize(gate_up.gguf_codes, gate_up.gguf_scales), want)
    assert hasattr(modules["model.layers.1.self_attn.o_proj"], "int4_weight")  # all Q4_0: the int4 kernel
    assert modules["lm_head"].gguf_layout == "int8g"

    prompts = random_prompts([3, 17, 40], 128)  # the tiny vocabulary
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    assert run_engine(packed, prompts, params) == run_engine(engine_for(mixed_gguf, dtype="float32"), prompts, params)
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    bf16 = engine_for(mixed_gguf, quantization="gguf", dtype="bfloat16")
    assert run_engine(bf16, prompts, short) == run_engine(engine_for(mixed_gguf, dtype="bfloat16"), prompts, short)


def test_the_repack_is_cached_and_read_on_later_loads(mixed_gguf, monkeypatch):
    import tandem_kernels.cpu
    from backend.models import gguf_packed

    if not tandem_kernels.cpu.available():
        pytest.skip("needs the fused CPU kernels")
    first = engine_for(mixed_gguf, quantization="gguf", dtype="float32")
    assert (first.config.model_path / gguf_packed.PACK_CACHE).is_file()

    def no_repack(*args):
        raise AssertionError("repacked again")

    monkeypatch.setattr(gguf_packed, "pack_tensors", no_repack)
    again = engine_for(mixed_gguf, quantization="gguf", dtype="float32")
    layer = dict(again.executor.worker.runner.model.named_modules())["model.layers.0.mlp.gate_up_proj"]
    assert layer.gguf_codes.shape == (2 * FFN, HIDDEN)


def test_packing_from_the_header_reader_matches_packing_from_ggufs_reader(mixed_gguf, monkeypatch):
    from types import SimpleNamespace

    from backend.models import gguf_packed
    from backend.models.gguf_file import GgufFile, GgufTensor

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)  # the tiny llama
    fast = gguf_packed.pack_tensors(mixed_gguf, config)

    def gguf_reader_file(path):
        tensors = [GgufTensor(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), np.asarray(t.data))
                   for t in gguf.GGUFReader(str(path)).tensors]
        return GgufFile({}, tensors)

    monkeypatch.setattr(gguf_packed, "read_gguf", gguf_reader_file)
    slow = gguf_packed.pack_tensors(mixed_gguf, config)
    assert {layout for layout, _, _ in fast.values()} == {"int4", "int4f", "int8g"}
    assert fast.keys() == slow.keys()
    for name, (layout, codes, scales) in fast.items():
        assert layout == slow[name][0], name
        for mine, theirs in zip((codes, scales), slow[name][1:]):
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, name
            assert mine.numpy().tobytes() == theirs.numpy().tobytes(), name


def test_an_unsupported_quantized_type_is_refused_by_name(tmp_path):
    import tandem_kernels.cpu

    if not tandem_kernels.cpu.available():
        pytest.skip("needs the fused CPU kernels")
    path = write_mixed_gguf(tmp_path / "q2k.gguf",
                            lambda name: "Q2_K" if name == "blk.0.attn_v.weight" else mixed_type(name))
    with pytest.raises(ValueError, match=r"blk\.0\.attn_v\.weight is GGUF type Q2_K"):
        engine_for(path, quantization="gguf", dtype="float32")
