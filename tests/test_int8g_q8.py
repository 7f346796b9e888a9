"""int8 activations for the GGUF layers in the grouped int8 layout whose codes fit 6 bits (Q5_K and
Q6_K parts, as Q4_K_M files hold; csrc/int8g_q8.cpp): the panels (and the C++ packs of both integer
kernels against their plain-torch contracts), the kernel against its plain-torch contract
(gguf_reference.int8g_q8_linear) and its batch invariance, and the engine option end to end."""

from __future__ import annotations

import pytest
import torch
from test_correctness import random_prompts, run_engine
from test_gguf_blocks import engine_for, write_mixed_gguf

import tandem_kernels.cpu
from tandem_kernels import gguf_reference as G
from backend.models.huge_pages import huge_pages_enabled
from backend.models.int4_weights import quantize_int4
from backend.types.sampling_params import SamplingParams

needs_kernels = pytest.mark.skipif(not tandem_kernels.cpu.available(), reason="needs the fused CPU kernels")


def int8g_weights(n: int, k: int, low: int = -32, high: int = 32, seed: int = 0):
    """codes [N, K] int8 in [low, high), scales [N, K / 16, 2] float32 (s, m), as Q6_K (m = 0) and Q5_K
    (codes >= 0, m < 0) give."""
    torch.manual_seed(seed)
    codes = torch.randint(low, high, (n, k), dtype=torch.int8)
    scales = torch.stack([torch.rand(n, k // 16) * 0.01 + 1e-3, -torch.rand(n, k // 16) * 0.05], dim=2)
    return codes, scales


def q8_kernel(x, codes, scales, bias):
    return tandem_kernels.cpu.int8g_q8_linear(x, *G.pack_int8g_q8(codes, scales), codes.shape[0], bias)


def test_panels_interleave_8_columns_of_shifted_codes():
    n, k = 11, 64  # two panels, the second padded with 5 zero columns
    codes, scales = int8g_weights(n, k)
    packed, sm = G.pack_int8g_q8(codes, scales)
    assert packed.shape == (2, k // 4, 32) and sm.shape == (2, k // 16, 2, 8)
    for col, kk in [(0, 0), (3, 17), (8, 42), (10, 63)]:
        p, j = col // 8, col % 8
        assert int(packed[p, kk // 4, 4 * j + kk % 4]) == int(codes[col, kk]) + 32, (col, kk)
        s, m = scales[col, kk // 16]
        assert sm[p, kk // 16, 0, j] == s and sm[p, kk // 16, 1, j] == m - 32 * s
    assert not packed[1, :, 12:].any() and not sm[1, :, :, 3:].any()
    assert G.int8g_fits_q8(codes) and not G.int8g_fits_q8(codes.clone().fill_(-33))
    with pytest.raises(ValueError, match=r"\[-32, 31\]"):
        G.pack_int8g_q8(torch.full((8, 32), 100, dtype=torch.int8), torch.ones(8, 2, 2))  # Q8_0's range


def test_reference_is_the_dequantized_matmul_on_the_rounded_activations():
    codes, scales = int8g_weights(24, 128, seed=3)
    x = torch.randn(5, 128)
    q, s = G.quantize_q8_groups(x)
    rounded = (q.float().view(5, -1, 32) * s[..., None]).view(5, 128)  # the activations the kernel sees
    want = rounded.double() @ G.int8g_dequantize(codes, scales).double().T
    torch.testing.assert_close(G.int8g_q8_linear(x, codes, scales, None), want.float(), rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,m,low", [(64, 256, 1, -32), (37, 512, 2, 0), (70, 1024, 9, -32), (16, 256, 11, 0),
                                        (16, 256, 12, -32), (16, 256, 14, 0), (21, 1024, 133, 0)])
def test_kernel_meets_its_reference(n, k, m, low, dtype):
    codes, scales = int8g_weights(n, k, low=low, high=32 if low < 0 else 32)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n)
    got, ref = q8_kernel(x, codes, scales, bias), G.int8g_q8_linear(x, codes, scales, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), ref.float(), rtol=8e-3, atol=1e-2)
    for row in range(m):  # a row's result does not depend on the rows beside it (tiles of 8 or 4, tails)
        alone = q8_kernel(x[row:row + 1].contiguous(), codes, scales, bias)
        assert torch.equal(alone, got[row:row + 1]), row


@needs_kernels
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_a_columns_result_does_not_depend_on_the_panels_beside_it(scale_dtype):
    """With AVX-512 VNNI two adjacent panels (16 columns) share one 512-bit tile, an odd last panel
    runs alone: a column gives the same bits in a pair, alone, and as the odd panel."""
    codes, scales = int8g_weights(24, 512)
    x = torch.randn(9, 512).to(torch.bfloat16)

    def kernel(lo, hi):
        packed, sm = G.pack_int8g_q8(codes[lo:hi].contiguous(), scales[lo:hi].contiguous())
        return tandem_kernels.cpu.int8g_q8_linear(x, packed, sm.to(scale_dtype), hi - lo, None)

    whole = kernel(0, 24)  # panels 0 and 1 paired, panel 2 alone
    for lo, hi in [(0, 8), (8, 16), (16, 24), (8, 24)]:  # alone, alone, alone, paired
        assert torch.equal(kernel(lo, hi), whole[:, lo:hi]), (lo, hi)


@needs_kernels
def test_zero_activations_give_the_bias_and_a_nan_reaches_its_row_only():
    codes, scales = int8g_weights(16, 512, seed=1)
    bias = torch.randn(16)
    assert torch.equal(q8_kernel(torch.zeros(3, 512), codes, scales, bias), bias.expand(3, 16))
    x = torch.randn(2, 512)
    x[1, 100] = float("nan")
    got = q8_kernel(x, codes, scales, None)
    assert got[1].isnan().all() and not got[0].isnan().any()
    exact = tandem_kernels.cpu.gguf_int8g_linear(x[:1], codes, scales, None)
    assert ((got[:1] - exact).norm() / exact.norm()).item() < 0.02  # the activations were rounded


@needs_kernels
def test_q5_k_and_q6_k_layers_run_the_integer_kernel_and_q8_0_ones_stay_exact(tmp_path, monkeypatch):
    mixed = write_mixed_gguf(tmp_path / "tiny-mixed.gguf")  # layer 0: qkv Q4_K | Q6_K | Q8_0, down Q6_K
    engine = engine_for(mixed, quantization="gguf", dtype="float32", int4_activations="int8", enforce_eager=True)
    modules = dict(engine.executor.worker.runner.model.named_modules())
    for name in ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_up_proj", "lm_head"):  # Q6_K, Q4_K | Q5_K
        assert hasattr(modules[name], "int8g_q8_panels") and not hasattr(modules[name], "gguf_codes"), name
    assert modules["model.layers.0.self_attn.qkv_proj"].gguf_layout == "int8g"  # Q8_0 rows: the float kernel
    exact = dict(engine_for(mixed, quantization="gguf", dtype="float32").executor.worker.runner.model.named_modules())
    down = exact["model.layers.0.mlp.down_proj"]
    packed, sm, n = modules["model.layers.0.mlp.down_proj"].int8g_q8_panels
    want_codes, want_sm = G.pack_int8g_q8(down.gguf_codes, down.gguf_scales)
    assert torch.equal(packed, want_codes) and sm.dtype == torch.float16 and n == down.gguf_codes.shape[0]
    torch.testing.assert_close(sm.float(), want_sm, rtol=1e-3, atol=1e-7)

    calls = []
    kernel = tandem_kernels.cpu.int8g_q8_linear
    monkeypatch.setattr(tandem_kernels.cpu, "int8g_q8_linear", lambda *a: calls.append(a[0].shape) or kernel(*a))
    prompts = random_prompts([3, 17, 40], 128)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batched = run_engine(engine, prompts, params)
    assert calls and all(len(out) == 12 for out in batched)
    assert batched == [run_engine(engine, [p], params)[0] for p in prompts]


@needs_kernels
def test_the_load_time_packs_are_the_reference_packs():
    for n, k in [(11, 64), (37, 512), (64, 2048)]:
        codes, scales = int8g_weights(n, k, seed=n)
        got, want = tandem_kernels.cpu.int8g_q8_pack(codes, scales), G.pack_int8g_q8(codes, scales)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        qweight, dm = quantize_int4(torch.randn(n, k))
        for dm_dtype in (torch.float16, torch.float32):
            got, want = tandem_kernels.cpu.int4_q8_pack(qweight, dm.to(dm_dtype)), G.pack_int4_q8(qweight, dm.to(dm_dtype))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[1].dtype == dm_dtype
    with pytest.raises(RuntimeError, match=r"\[-32, 31\]"):
        tandem_kernels.cpu.int8g_q8_pack(torch.full((8, 32), -33, dtype=torch.int8), torch.ones(8, 2, 2))


def mapping_path(address: int) -> str:
    """The file behind the mapping of this process that holds ``address`` ('' for anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"no mapping holds {address:#x}")


def held_packs(model):
    """The packed weights' tensors the model's linear layers run on, whichever kernel takes them."""
    for module in model.modules():
        for kind in ("int4_q8_panels", "int8g_q8_panels", "int4_weight", "int4_scales", "gguf_codes", "gguf_scales"):
            value = getattr(module, kind, None)
            yield from (t for t in (value if isinstance(value, tuple) else (value,)) if torch.is_tensor(t))


@needs_kernels
@pytest.mark.skipif(not huge_pages_enabled(), reason="the copy is made where the system has 2 MB pages (Linux THP)")
def test_the_panels_read_from_the_cache_live_in_anonymous_memory(tmp_path):
    """Not in a mapping of the cache file: only anonymous memory goes onto 2 MB pages
    (huge_pages.collapse_large_mappings), and a decode step streams these weights."""
    from backend.models.gguf_packed import PACK_CACHE, PANEL_CACHE

    mixed = write_mixed_gguf(tmp_path / "tiny-mixed.gguf")
    for int4_activations, cache in (("int8", PANEL_CACHE), ("exact", PACK_CACHE)):
        engine_for(mixed, quantization="gguf", dtype="float32", int4_activations=int4_activations)  # writes it
        again = engine_for(mixed, quantization="gguf", dtype="float32", int4_activations=int4_activations)
        assert (again.config.model_path / cache).is_file()
        weights = list(held_packs(again.executor.worker.runner.model))
        assert weights, int4_activations
        assert {mapping_path(t.data_ptr()) for t in weights} <= {"", "[heap]"}, int4_activations


@needs_kernels
@pytest.mark.skipif(not huge_pages_enabled(), reason="the copy is made where the system has 2 MB pages (Linux THP)")
def test_only_what_comes_from_a_mapped_cache_is_copied(tmp_path, monkeypatch):
    """The first load builds the packs and panels in the process's own memory (the runner's
    collapse moves them): nothing to copy; the next load maps both caches and copies what it keeps."""
    from backend.models import gguf_packed

    copied = []

    def counting(tensors):
        copied.append(len(tensors))
        return gguf_packed_copies(tensors)

    gguf_packed_copies = gguf_packed.copies_in_one_arena
    monkeypatch.setattr(gguf_packed, "copies_in_one_arena", counting)
    mixed = write_mixed_gguf(tmp_path / "tiny-mixed.gguf")
    engine_for(mixed, quantization="gguf", dtype="float32", int4_activations="int8")
    assert copied == []
    engine_for(mixed, quantization="gguf", dtype="float32", int4_activations="int8")
    assert len(copied) == 1 and copied[0] > 0


@needs_kernels
def test_the_panels_are_cached_beside_the_packs_and_read_on_the_next_load(tmp_path):
    from backend.models.gguf_packed import PANEL_CACHE

    mixed = write_mixed_gguf(tmp_path / "tiny-mixed.gguf")
    first = engine_for(mixed, quantization="gguf", dtype="float32", int4_activations="int8")
    cache = first.config.model_path / PANEL_CACHE
    assert cache.is_file()
    stamp = cache.stat().st_mtime_ns
    again = engine_for(mixed, quantization="gguf", dtype="float32", int4_activations="int8")
    assert cache.stat().st_mtime_ns == stamp  # read, not rewritten
    before = dict(first.executor.worker.runner.model.named_modules())
    after = dict(again.executor.worker.runner.model.named_modules())
    for name, module in after.items():
        for kind in ("int4_q8_panels", "int8g_q8_panels"):
            if hasattr(module, kind):
                assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b
                           for a, b in zip(getattr(module, kind), getattr(before[name], kind))), name
    assert hasattr(after["model.layers.1.mlp.gate_up_proj"], "int4_q8_panels")  # Q4_K | Q4_0
    assert hasattr(after["model.layers.0.mlp.down_proj"], "int8g_q8_panels")  # Q6_K
    assert after["model.layers.0.self_attn.qkv_proj"].gguf_layout == "int8g"  # Q8_0 rows: no panels
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts([5, 11], 128)
    assert run_engine(again, prompts, params) == run_engine(first, prompts, params)
