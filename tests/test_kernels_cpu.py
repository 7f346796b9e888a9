"""The fused CPU kernels (kernels/tandem_kernels/csrc/, one file per op family) against their plain-torch twins,
and the AMX linear (kernels/tandem_kernels/csrc/amx_linear.cpp, where the CPU has AMX) against the exact matmul;
and the build's cache key, which covers every file in kernels/tandem_kernels/csrc/.

Mixed batches: decodes and prefill chunks with cached prefixes, block
boundaries crossed, GQA. fp32 must agree to float rounding (rotary and norms
bit for bit), bf16 within bf16 rounding.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import tandem_kernels.cpu as cpu
from tandem_kernels import build, isa, reference

cpu.available()  # build or load the kernels (the launchers below assume they are loaded)

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def test_kernels_are_built():
    """Every machine with a C++ compiler (CI's too) runs the fused kernels: no silent fallback."""
    assert cpu.available(), cpu.unavailable_reason()


def test_editing_any_kernel_file_rebuilds(tmp_path, monkeypatch):
    """The libraries' names (prebuilt and cached) are keyed on every source and header (an edit, or a
    file added, gives another name, so the next start builds), and on nothing that an edit undone changes."""
    csrc = shutil.copytree(build.CSRC, tmp_path / "csrc")
    monkeypatch.setattr(build, "CSRC", csrc)
    compiler = build.compiler()
    level = isa.LEVELS[0]

    def names():
        return build.library_name(level), build.cached_library(level, compiler).name

    base = names()
    files = sorted(csrc.iterdir())
    assert {"registration.cpp", "ops.h", "simd.h", "amx_linear.cpp"} <= {f.name for f in files}
    assert [f.name for f in build.sources()] == sorted(f.name for f in files if f.suffix == ".cpp")
    seen = set()
    for f in files:
        text = f.read_text()
        f.write_text(text + "\n// edited\n")
        seen.add(names())
        f.write_text(text)
    assert base not in seen and len(seen) == len(files)
    assert names() == base
    (csrc / "added.h").write_text("#pragma once\n")
    assert names()[0] != base[0] and names()[1] != base[1]


def _batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    shape = reference.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    # Block IDs shuffled so requests' blocks are not adjacent.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, next_block = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[next_block:next_block + n])
        next_block += n
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, block_tables


def reference_and_fused_attention(query, k_cache, v_cache, block_tables, query_lens, seq_lens, block_size,
                                  scale):
    """(reference, fused) paged attention over the caches; the reference reads a fresh prefill's
    K/V from its key/value arguments, so they are given the cache's own rows."""
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    key = torch.empty(query.shape[0], num_kv_heads, head_dim, dtype=k_cache.dtype)
    value = torch.empty_like(key)
    row = 0
    for q_len, s, table in zip(query_lens, seq_lens, block_tables.tolist()):
        for p in range(s - q_len, s):
            key[row] = k_cache[table[p // block_size], :, p % block_size]
            value[row] = v_cache[table[p // block_size], :, p % block_size]
            row += 1
    plan = reference.plan_attention(block_tables, seq_lens, query_lens, block_size)
    expected = reference.paged_attention(query, key, value, k_cache, v_cache, plan, scale)
    starts = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    got = cpu.paged_attention(query, k_cache, v_cache, block_tables.to(torch.int32),
                              torch.tensor(seq_lens, dtype=torch.int32), starts, scale)
    return expected, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [8, 16, 64])  # each path: 8 lanes, 16 lanes, 32-wide bf16 pairs
@pytest.mark.parametrize("block_size", [8, 5])  # PV pairs rows within a block: odd sizes take the other path
def test_paged_attention_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    # decode, decode across a block boundary, a prefill from nothing, a chunk after a prefix hit
    query_lens = [1, 1, 7, 5, 1]
    seq_lens = [9, 17, 7, 21, 33]
    query, k_cache, v_cache, block_tables = _batch(query_lens, seq_lens, num_heads, num_kv_heads,
                                                   head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    expected, got = reference_and_fused_attention(query, k_cache, v_cache, block_tables, query_lens, seq_lens,
                                                  block_size, scale)
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [2, 24])
def test_paged_attention_shares_out_work_either_way(dtype, num_tokens):
    """Decode batches of a few tokens (an item per KV head) and of many (an item per token, its KV
    heads read block by block), on one thread and on two, agree with the reference."""
    query_lens, seq_lens = [1] * num_tokens, [40 + 7 * i for i in range(num_tokens)]
    batch = _batch(query_lens, seq_lens, 9, 3, 64, 16, dtype, seed=num_tokens)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            expected, got = reference_and_fused_attention(*batch, query_lens, seq_lens, 16, 0.125)
            torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])
    finally:
        torch.set_num_threads(threads)


def test_paged_attention_reads_strided_query_rows():
    """q as a view into a fused QKV output (rows strided) gives the same result."""
    query, k_cache, v_cache, tables = _batch([1, 1], [5, 12], 4, 2, 8, 4, torch.float32)
    wide = torch.cat([query.view(2, -1), torch.zeros(2, 16)], dim=1)
    strided = wide[:, :32].view(2, 4, 8)
    args = (k_cache, v_cache, tables.to(torch.int32), torch.tensor([5, 12], dtype=torch.int32),
            torch.tensor([0, 1, 2], dtype=torch.int32), 0.3)
    torch.testing.assert_close(cpu.paged_attention(strided, *args), cpu.paged_attention(query, *args))


def test_paged_attention_rejects_bad_metadata():
    query, k_cache, v_cache, tables = _batch([1], [5], 2, 2, 8, 4, torch.float32)
    with pytest.raises(RuntimeError, match="seq_len"):  # more tokens than the table holds
        cpu.paged_attention(query, k_cache, v_cache, tables.to(torch.int32),
                            torch.tensor([99], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        cpu.paged_attention(query, k_cache, v_cache, tables, torch.tensor([5]),
                            torch.tensor([0, 1]), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, 3 * 2 * 8, generator=gen).to(dtype)
    key = qkv[:, 16:32].view(6, 2, 8)  # strided views, as the models pass them
    value = qkv[:, 32:].view(6, 2, 8)
    slots = torch.tensor([3, 4, 9, 17, 0, 22])
    caches = [torch.zeros(reference.kv_cache_shape(6, 4, 2, 8), dtype=dtype) for _ in range(4)]
    reference.write_kv_cache(key, value, caches[0], caches[1], slots)
    cpu.write_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.write_kv_cache(key, value, caches[2], caches[3], torch.tensor([0, 1, 2, 3, 4, 96]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(37, 72, generator=gen).to(dtype)
    residual = torch.randn(37, 72, generator=gen).to(dtype)
    weight = torch.rand(72, generator=gen).to(dtype)
    exact = dict(atol=0, rtol=0) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6),
                               **(TOL[dtype] if dtype != torch.float32 else dict(atol=1e-6, rtol=1e-6)))
    want_x, want_res = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    got_x, got_res = cpu.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    torch.testing.assert_close(got_res, want_res, **exact)  # the add rounds identically
    torch.testing.assert_close(got_x, want_x, **(TOL[dtype] if dtype != torch.float32
                                                 else dict(atol=1e-6, rtol=1e-6)))


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotary_matches_reference_bit_for_bit(rotary_dim):
    gen = torch.Generator().manual_seed(3)
    head_dim = 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cache = reference.rotary_cos_sin(inv_freq, 64)
    qkv = torch.randn(5, (3 + 1 + 1) * head_dim, generator=gen)
    query, key = qkv[:, :3 * head_dim], qkv[:, 3 * head_dim:4 * head_dim]
    positions = torch.tensor([0, 1, 7, 30, 63])
    want_q, want_k = reference.apply_rotary(positions, query, key, cache, head_dim)
    got_q, got_k = cpu.apply_rotary(positions, query.clone(), key.clone(), cache, head_dim)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_silu_and_mul_matches_reference():
    x = torch.randn(9, 2 * 40, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(cpu.silu_and_mul(x), reference.silu_and_mul(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("m, k, n", [(1, 64, 12), (5, 72, 9), (7, 13, 4)])  # tails in k and n
def test_int8_linear_equals_its_dequantized_reference(m, k, n):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02
    bias = torch.randn(n, generator=gen)
    dequantized = weight.float() * scale.unsqueeze(1)
    torch.testing.assert_close(cpu.int8_linear(x, weight, scale, bias),
                               torch.nn.functional.linear(x, dequantized, bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu.int8_linear(x, weight, scale, None),
                               torch.nn.functional.linear(x, dequantized), atol=1e-5, rtol=1e-5)
    # A row's result does not depend on the rows batched with it.
    torch.testing.assert_close(cpu.int8_linear(x[:1], weight, scale, None)[0],
                               cpu.int8_linear(x, weight, scale, None)[0], atol=0, rtol=0)


def int8_case(m, k, n, seed):
    """x [m, k] (one all-zero 32-wide block in its last row), int8 weight [n, k], scale [n], bias [n]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 4
    x[-1, :32] = 0
    weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    weight[0, :min(k, 5)] = -128  # int8's one value without a positive twin (the AVX2 w8a8 kernel takes |w|)
    return x, weight, torch.rand(n, generator=gen) * 0.02, torch.randn(n, generator=gen)


# Odd k and n (tails of every vector width and 32-wide block), 1 row to more than a row block.
INT8_SHAPES = [(1, 64, 12), (2, 13, 4), (5, 72, 9), (7, 70, 17), (33, 576, 50), (70, 100, 33), (130, 128, 6)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", INT8_SHAPES)
def test_int8_linear_equals_its_reference_in_the_activations_dtype(m, k, n, dtype):
    x, weight, scale, bias = int8_case(m, k, n, seed=9)
    x = x.to(dtype)
    for b in (bias, bias.to(dtype), None):
        got, want = cpu.int8_linear(x, weight, scale, b), reference.int8_linear(x, weight, scale, b)
        assert got.dtype == dtype and got.shape == (m, n)
        # float32: the same products summed in another order; bf16: rounded once from those sums.
        tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -7)
        torch.testing.assert_close(got, want, **tol)
    whole = cpu.int8_linear(x, weight, scale, None)
    for i in (0, m - 1):  # a row's result does not depend on the rows batched with it
        assert torch.equal(cpu.int8_linear(x[i:i + 1], weight, scale, None)[0], whole[i])


needs_amx = pytest.mark.skipif(not cpu.amx_available(), reason="needs a CPU with AMX (Intel Sapphire Rapids or later)")


@needs_amx
@pytest.mark.parametrize("m, k, n", [(1, 64, 32), (5, 70, 33), (33, 576, 100), (70, 40, 300)])  # pads in m, k, n
def test_amx_linear_is_the_exact_sum_rounded_once_to_bf16(m, k, n):
    gen = torch.Generator().manual_seed(7)
    x, weight, bias = (torch.randn(shape, generator=gen).bfloat16() for shape in ((m, k), (n, k), (n,)))
    packed = cpu.amx_pack_weight(weight)
    for b in (bias, None):
        exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        got = cpu.amx_linear(x, packed, n, b)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # bf16 keeps 8 significant bits: rounding once is within half a unit, 2^-8 relative; the
        # fp32 sums (in another order than F.linear's) add ~1e-6.
        torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-5)
    # A row's result does not depend on the rows batched with it (prefill and decode agree).
    assert torch.equal(cpu.amx_linear(x[:1], packed, n, None)[0], cpu.amx_linear(x, packed, n, None)[0])
    strided = torch.randn(m, k + 8, generator=gen).bfloat16()[:, 3:k + 3]  # rows not contiguous
    assert torch.equal(cpu.amx_linear(strided, packed, n, None), cpu.amx_linear(strided.contiguous(), packed, n, None))


@needs_amx
@pytest.mark.parametrize("m, k, d", [(1, 40, 32), (5, 64, 64), (33, 70, 96)])  # pads in m and k
def test_amx_gated_linear_is_silu_and_mul_of_amx_linear_bit_for_bit(m, k, d):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(m, k, generator=gen).bfloat16()
    weight = (torch.randn(2 * d, k, generator=gen) * k ** -0.5).bfloat16()  # [gate | up]
    expected = cpu.silu_and_mul(cpu.amx_linear(x, cpu.amx_pack_weight(weight), 2 * d, None))
    got = cpu.amx_gated_linear(x, cpu.amx_pack_weight(weight[cpu.amx_gated_order(d)]), d)
    assert got.shape == (m, d) and torch.equal(got, expected)
    gate_up = torch.nn.functional.linear(x.float(), weight.float()).bfloat16()  # within an ulp of the kernel's
    torch.testing.assert_close(got.float(), reference.silu_and_mul(gate_up.float()), rtol=2 ** -6, atol=1e-3)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu.amx_gated_linear(x, cpu.amx_pack_weight(weight), d + 16)


@needs_amx
def test_amx_linear_refuses_a_weight_of_another_shape():
    packed = cpu.amx_pack_weight(torch.randn(40, 64).bfloat16())
    with pytest.raises(RuntimeError, match="columns"):
        cpu.amx_linear(torch.randn(2, 96).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="n does not fit"):
        cpu.amx_linear(torch.randn(2, 64).bfloat16(), packed, 80, None)
    assert cpu.amx_linear(torch.randn(0, 64).bfloat16(), packed, 40, None).shape == (0, 40)


# a partial block; 4-row tiles; more than 128 rows
@pytest.mark.parametrize("m, k, n", [(1, 64, 12), (6, 96, 9), (9, 70, 5), (130, 128, 6)])
def test_w8a8_linear_equals_its_reference(m, k, n):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(m, k, generator=gen) * 4
    x[-1, :32] = 0  # an all-zero block: scale 0
    weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02
    bias = torch.randn(n, generator=gen)
    for b in (bias, None):
        torch.testing.assert_close(cpu.w8a8_linear(x, weight, scale, b), reference.w8a8_linear(x, weight, scale, b),
                                   atol=1e-5, rtol=1e-5)
    whole = cpu.w8a8_linear(x, weight, scale, None)
    for i in range(m):  # a row's result does not depend on the rows batched with it
        assert torch.equal(cpu.w8a8_linear(x[i:i + 1], weight, scale, None)[0], whole[i])


needs_bf16_dot = pytest.mark.skipif(not cpu.int8_bf16_available(), reason="needs a CPU with AVX-512 BF16")


@needs_bf16_dot
@pytest.mark.parametrize("m, k, n", INT8_SHAPES + [(6, 97, 20)])  # an odd K: x ends mid-pair
def test_int8_packed_equals_its_reference_and_rows_do_not_depend_on_their_batch(m, k, n):
    x, weight, scale, bias = int8_case(m, k, n, seed=12)
    x = x.bfloat16()
    packed = cpu.int8_pack_weight_bf16(weight)
    assert packed.shape == (-(-n // 16), -(-k // 2) * 32)  # 16-column panels of k pairs
    for b in (bias, bias.bfloat16(), None):
        got = cpu.int8_linear_packed(x, packed, scale, b)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        torch.testing.assert_close(got, reference.int8_linear(x, weight, scale, b), atol=1e-2, rtol=2 ** -7)
    whole = cpu.int8_linear_packed(x, packed, scale, None)
    for i in range(m):  # 6-row tiles and their tails sum alike
        assert torch.equal(cpu.int8_linear_packed(x[i:i + 1], packed, scale, None)[0], whole[i])
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu.int8_linear_packed(x.float(), packed, scale, None)
    with pytest.raises(RuntimeError, match="int8_pack_weight_bf16 of"):
        cpu.int8_linear_packed(x[:, :-2], packed, scale, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", INT8_SHAPES)
def test_w8a8_linear_equals_its_reference_in_the_activations_dtype(m, k, n, dtype):
    x, weight, scale, bias = int8_case(m, k, n, seed=10)
    x = x.to(dtype)
    packed = cpu.w8a8_pack_weight(weight)  # read by the VNNI, AVX2 or plain-loop kernel, whichever was built
    for b in (bias, bias.to(dtype), None):
        want = reference.w8a8_linear(x, weight, scale, b)
        for got in (cpu.w8a8_linear(x, weight, scale, b), cpu.w8a8_linear_packed(x, packed, scale, b)):
            assert got.dtype == dtype and got.shape == (m, n)
            # The same exact block sums, added in float in another order (bf16: then rounded once).
            tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -7)
            torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", [(9, 70, 5), (70, 576, 33), (131, 64, 40)])
def test_w8a8_packed_rows_do_not_depend_on_their_batch(m, k, n, dtype):
    x, weight, scale, _ = int8_case(m, k, n, seed=11)
    x = x.to(dtype)
    packed = cpu.w8a8_pack_weight(weight)
    whole = cpu.w8a8_linear_packed(x, packed, scale, None)
    for i in range(m):  # 4-row tiles, their tails and the 64-row blocks all sum alike
        assert torch.equal(cpu.w8a8_linear_packed(x[i:i + 1], packed, scale, None)[0], whole[i])
    assert torch.equal(cpu.w8a8_linear_packed(x[m // 3:], packed, scale, None), whole[m // 3:])


def test_w8a8_packed_refuses_a_weight_of_another_shape():
    weight = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    packed, scale = cpu.w8a8_pack_weight(weight), torch.ones(40)
    assert packed.shape == (3, 2 * 512) and packed.dtype == torch.uint8  # 16-column panels, 32-wide blocks
    with pytest.raises(RuntimeError, match="w8a8_pack_weight of"):
        cpu.w8a8_linear_packed(torch.randn(2, 96), packed, scale, None)
    with pytest.raises(RuntimeError, match="w8a8_pack_weight of"):
        cpu.w8a8_linear_packed(torch.randn(2, 64), packed, torch.ones(60), None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu.w8a8_linear_packed(torch.randn(2, 64).half(), packed, scale, None)
    assert cpu.w8a8_linear_packed(torch.randn(0, 64), packed, scale, None).shape == (0, 40)


def test_w8a8_reference_quantizes_each_block_to_its_own_scale():
    x = torch.cat([torch.full((1, 32), 0.5), torch.linspace(-8, 8, 40).unsqueeze(0)], dim=1)  # [1, 72]
    q, s = reference.quantize_activation_blocks(x)
    assert q.shape == (1, 72) and s.shape == (1, 3)
    assert torch.equal(q[0, :32], torch.full((32,), 127, dtype=torch.int8))
    torch.testing.assert_close(s[0], torch.tensor([0.5, 8.0, 8.0]) / 127)
    assert ((q.float() * s.repeat_interleave(32, dim=1)[:, :72] - x).abs() <= s.repeat_interleave(32, dim=1)[:, :72] / 2 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_reference(dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 1000 + 5, generator=gen).to(dtype)  # a tail past the 16-lane chunks
    x[1, [3, 700]] = 50.0  # a tie: the first one wins
    x[2, 1004] = 50.0  # the maximum in the tail
    x[3] = -float("inf")
    x[4, [9, 600]] = float("nan")  # a NaN counts as the maximum, as in torch.max
    x[5, 17] = float("inf")
    assert torch.equal(cpu.argmax_rows(x), reference.argmax_rows(x))
    assert cpu.argmax_rows(x).tolist() == [int(x[0].float().argmax()), 3, 1004, 0, 9, 17]


def test_apply_penalties_matches_reference_bit_for_bit():
    gen = torch.Generator().manual_seed(11)
    vocab, slots = 1000 + 3, 7
    prompt_seen = torch.rand(slots, vocab, generator=gen) < 0.1
    output_counts = torch.randint(0, 4, (slots, vocab), generator=gen, dtype=torch.int32)
    output_counts[output_counts < 3] = 0  # mostly unseen
    logits = torch.randn(9, vocab, generator=gen) * 5
    logits[0, :4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    rows = torch.tensor([8, 0, 3, 5, 1])  # some rows untouched, in any order
    table = torch.tensor([2, 6, 0, 2, 4])  # a slot may serve two rows
    repetition = torch.tensor([1.3, 1.0, 0.8, 2.0, 1.0])
    frequency = torch.tensor([0.0, 0.5, -1.0, 0.25, 0.0])
    presence = torch.tensor([0.0, -0.4, 1.5, 0.0, 2.0])
    expected, actual = logits.clone(), logits.clone()
    args = (rows, prompt_seen, output_counts, table, repetition, frequency, presence)
    reference.apply_penalties(expected, *args)
    cpu.apply_penalties(actual, *args)
    assert torch.equal(actual, expected)
    assert torch.equal(actual[[2, 4, 6, 7]], logits[[2, 4, 6, 7]])
    assert not torch.equal(actual[8], logits[8])
    with pytest.raises(RuntimeError, match="slot is out of range"):
        cpu.apply_penalties(actual, rows, prompt_seen, output_counts, torch.tensor([0, 0, 0, 0, slots]),
                            repetition, frequency, presence)
