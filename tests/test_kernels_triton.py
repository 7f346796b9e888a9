"""Every Triton kernel against its plain-torch twin in kernels.reference.

Without CUDA they run under TRITON_INTERPRET=1 (set by conftest.py) on CPU
tensors, so shapes stay small; with CUDA the same cases run compiled. The
realistic shapes are in test_gpu_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import make_paged_batch
from tandem_kernels import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (dtype, atol=rtol): fp32 dots are IEEE (no TF32), so only summation order differs.
TOLERANCES = [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)]


@pytest.fixture(scope="module")
def triton_kernels():
    from tandem_kernels import attention, cache_ops, norms, rotary

    return attention, cache_ops, norms, rotary


# (tokens cached before, tokens this step): decodes at several context lengths (one
# exactly at a block edge, one past a 64-token KV tile), a fresh prompt, chunks after
# prefix hits that start and end mid-block.
MIXED = [(9, 1), (0, 7), (70, 19), (31, 1), (0, 1), (16, 1), (5, 12)]


@pytest.mark.parametrize("dtype, tol", TOLERANCES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (6, 2, 16, 4),  # GQA, 3 query heads per KV head
    (4, 4, 32, 16),  # MHA
    (8, 1, 24, 8),  # MQA, a head_dim that is not a power of two
])
def test_paged_attention_mixed_batch(triton_kernels, dtype, tol, heads, kv_heads, head_dim, block_size):
    attention = triton_kernels[0]
    b = make_paged_batch(MIXED, heads, kv_heads, head_dim, block_size, dtype, DEVICE)
    scale = head_dim ** -0.5
    got = attention.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache, b.varlen_plan(), scale)
    b_cpu = make_paged_batch(MIXED, heads, kv_heads, head_dim, block_size, dtype, "cpu")
    want = R.paged_attention(b_cpu.query, b_cpu.key, b_cpu.value, b_cpu.k_cache, b_cpu.v_cache,
                             b_cpu.plan(), scale)
    assert got.shape == b.query.shape and got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


# Real models' head shapes at the launch configs they get (tandem_kernels.launch_config):
# wide heads take 32-token KV tiles in prefill, head dim 256 also 32-row tiles and 8-warp decodes.
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [
    (8, 1, 256),  # Gemma-2B: GQA group 8
    (4, 1, 128),  # Llama-3.1-8B's group of 4
    (6, 2, 96),  # Phi-3-mini's head dim, a group of 3
    (2, 2, 80),  # Phi-2: MHA, head dim padded to 128
])
def test_paged_attention_real_head_dims(triton_kernels, dtype, tol, heads, kv_heads, head_dim):
    attention = triton_kernels[0]
    shapes = [(9, 1), (0, 7), (70, 19), (40, 1)]
    b = make_paged_batch(shapes, heads, kv_heads, head_dim, 16, dtype, DEVICE)
    scale = head_dim ** -0.5
    got = attention.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache, b.varlen_plan(), scale)
    b_cpu = make_paged_batch(shapes, heads, kv_heads, head_dim, 16, dtype, "cpu")
    want = R.paged_attention(b_cpu.query, b_cpu.key, b_cpu.value, b_cpu.k_cache, b_cpu.v_cache,
                             b_cpu.plan(), scale)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", TOLERANCES)
def test_split_kv_decode_matches_one_pass(triton_kernels, dtype, tol):
    """Decodes only, contexts cut into 64-token partitions: split count 1, 2 and 4."""
    attention = triton_kernels[0]
    shapes = [(200, 1), (3, 1), (64, 1), (129, 1)]
    b = make_paged_batch(shapes, 6, 2, 16, 16, dtype, DEVICE)
    scale = 0.25
    want = R.paged_attention(b.query.cpu(), b.key.cpu(), b.value.cpu(), b.k_cache.cpu(), b.v_cache.cpu(),
                             make_paged_batch(shapes, 6, 2, 16, 16, dtype).plan(), scale)
    for splits in (1, 2, 4):
        plan = b.varlen_plan(num_splits=splits)
        assert attention.split_layout(plan, 2, b.query.device)[0] == splits
        got = attention.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache, plan, scale)
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


def test_reference_runs_a_varlen_plan():
    """The reference takes the Triton kernel's metadata form too (a replayed graph on the CPU)."""
    b = make_paged_batch(MIXED, 6, 2, 16, 4)
    via_varlen = R.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache, b.varlen_plan(), 0.25)
    direct = R.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache, b.plan(), 0.25)
    torch.testing.assert_close(via_varlen, direct, atol=0, rtol=0)


def test_attention_refuses_mismatched_inputs(triton_kernels):
    attention = triton_kernels[0]
    b = make_paged_batch([(3, 1)], 4, 2, 16, 4, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        attention.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache,
                                  b.varlen_plan(block_tables=b.block_tables.long()), 0.25)
    with pytest.raises(ValueError, match="dtypes differ"):
        attention.paged_attention(b.query.double(), b.key, b.value, b.k_cache, b.v_cache, b.varlen_plan(), 0.25)
    with pytest.raises(ValueError, match="group"):
        attention.paged_attention(b.query[:, :3], b.key, b.value, b.k_cache, b.v_cache, b.varlen_plan(), 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_from_strided_views(triton_kernels, dtype):
    cache_ops = triton_kernels[1]
    num_tokens, kvh, d, block_size = 7, 3, 16, 4
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(num_tokens, (2 + 2 * kvh) * d, generator=g).to(dtype)  # q | k | v like a fused QKV
    key = qkv[:, 2 * d:(2 + kvh) * d].view(num_tokens, kvh, d)
    value = qkv[:, (2 + kvh) * d:].view(num_tokens, kvh, d)
    slots = torch.tensor([0, 5, 6, 31, 12, 13, 22])
    caches = [torch.zeros(R.kv_cache_shape(8, block_size, kvh, d), dtype=dtype) for _ in range(4)]
    R.write_kv_cache(key, value, caches[0], caches[1], slots)
    dev = [c.to(DEVICE) for c in caches[2:]]
    cache_ops.write_kv_cache(key.to(DEVICE), value.to(DEVICE), dev[0], dev[1], slots.to(DEVICE).int())
    assert torch.equal(dev[0].cpu(), caches[0]) and torch.equal(dev[1].cpu(), caches[1])


@pytest.mark.parametrize("dtype, tol", TOLERANCES)
@pytest.mark.parametrize("hidden", [64, 72])
def test_rms_norm_and_fused_add(triton_kernels, dtype, tol, hidden):
    norms = triton_kernels[2]
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, hidden, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(hidden, generator=g).to(dtype)
    got = norms.rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6)
    torch.testing.assert_close(got.cpu(), R.rms_norm(x, weight, 1e-6), atol=tol, rtol=tol)
    normed, summed = norms.fused_add_rms_norm(x.to(DEVICE), residual.to(DEVICE), weight.to(DEVICE), 1e-6)
    want_normed, want_summed = R.fused_add_rms_norm(x, residual, weight, 1e-6)
    if DEVICE == "cuda":
        assert torch.equal(summed.cpu(), want_summed)  # the add rounds exactly as torch's
    else:  # the interpreter rounds fp32 -> bf16 toward zero, not to nearest: one ulp apart
        torch.testing.assert_close(summed, want_summed, atol=1e-6, rtol=2 ** -7)
    torch.testing.assert_close(normed.cpu(), want_normed, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", TOLERANCES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary
def test_rotary_in_place_on_qkv_views(triton_kernels, dtype, tol, is_neox, rotary_dim):
    rotary = triton_kernels[3]
    num_tokens, heads, kvh, d = 6, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cache = R.rotary_cos_sin(inv_freq, 64)
    positions = torch.tensor([0, 1, 17, 63, 5, 40])
    qkv = torch.randn(num_tokens, (heads + 2 * kvh) * d, generator=g).to(dtype)
    q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    want_q, want_k = R.apply_rotary(positions, q, k, cache, d, is_neox)
    dev = qkv.to(DEVICE)
    dq, dk, dv = dev.split([heads * d, kvh * d, kvh * d], dim=-1)
    out_q, out_k = rotary.apply_rotary(positions.to(DEVICE), dq, dk, cache.to(DEVICE), d, is_neox)
    assert out_q.data_ptr() == dq.data_ptr() and out_k.data_ptr() == dk.data_ptr()  # in place
    torch.testing.assert_close(dq.cpu(), want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(dk.cpu(), want_k, atol=tol, rtol=tol)
    assert torch.equal(dv.cpu(), v)


@pytest.mark.parametrize("dtype, tol", TOLERANCES + [(torch.float16, 1e-3)])
@pytest.mark.parametrize("width", [40, 1536 + 24])  # one column block; several, the last partial
def test_silu_and_mul(dtype, tol, width):
    from tandem_kernels import activations

    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(5, 2 * width, generator=g)).to(dtype)
    got = activations.silu_and_mul(x.to(DEVICE))
    assert got.shape == (5, width) and got.dtype == dtype
    # The kernel rounds once (fp32 product); the reference rounds silu(gate) first.
    torch.testing.assert_close(got.cpu().float(), R.silu_and_mul(x.float()), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="2 \\* d"):
        activations.silu_and_mul(x[:, :-1])


class _SaysCuda(torch.Tensor):
    """A CPU tensor that reports itself on CUDA (views and results keep the subclass)."""

    is_cuda = property(lambda self: True)
    is_cpu = property(lambda self: False)


def test_cuda_tensors_never_build_the_cpu_kernels(monkeypatch):
    """On CUDA tensors silu_and_mul, argmax_rows, penalized_argmax and qkv_attention go to Triton / torch without
    asking for the C++ kernels (asking builds them: g++ for tens of seconds, in the first
    CUDA forward of a server start-up)."""
    from types import SimpleNamespace

    from tandem_kernels import cpu, ops

    def no_build():
        raise AssertionError("the CPU kernels were asked for on a CUDA tensor")

    monkeypatch.setattr(ops, "_fused_cpu", [])
    monkeypatch.setattr(cpu, "available", no_build)
    launched = []

    def triton_op(name, result):
        def op(*args, **kwargs):
            launched.append(name)
            return result(*args)
        return op

    fake = {
        "activations": SimpleNamespace(silu_and_mul=triton_op("silu_and_mul", R.silu_and_mul)),
        "rotary": SimpleNamespace(apply_rotary=triton_op("apply_rotary", lambda pos, q, k, *_: (q, k))),
        "cache_ops": SimpleNamespace(write_kv_cache=triton_op("write_kv_cache", lambda *_: None)),
        "attention": SimpleNamespace(paged_attention=triton_op("paged_attention", lambda q, *_: q.clone())),
    }
    monkeypatch.setattr(ops, "_triton", lambda module: fake[module])

    x = torch.randn(3, 8).as_subclass(_SaysCuda)
    assert x.is_cuda and not x.is_cpu
    torch.testing.assert_close(ops.silu_and_mul(x).as_subclass(torch.Tensor), R.silu_and_mul(x.as_subclass(torch.Tensor)))
    assert torch.equal(ops.argmax_rows(x).as_subclass(torch.Tensor), x.as_subclass(torch.Tensor).argmax(-1))
    seen, counts = torch.zeros(2, 8, dtype=torch.bool), torch.zeros(2, 8, dtype=torch.int32)
    tokens = ops.penalized_argmax(x, torch.tensor([2]), seen, counts, torch.tensor([1]), torch.tensor([1.5]),
                                  torch.tensor([0.0]), torch.tensor([0.0]), True)
    assert torch.equal(tokens.as_subclass(torch.Tensor), x.as_subclass(torch.Tensor).argmax(-1))
    assert counts.sum() == 1 and counts[1, tokens[2]] == 1

    b = make_paged_batch([(3, 2)], 4, 2, 16, 4)
    qkv = torch.cat([b.query.flatten(1), b.key.flatten(1), b.value.flatten(1)], 1).as_subclass(_SaysCuda)
    out = ops.qkv_attention(qkv, torch.tensor([3, 4]), torch.zeros(8, 16), True, b.k_cache, b.v_cache,
                            b.slot_mapping, b.varlen_plan(), 4, 2, 16, 0.25)
    assert out.shape == (2, 64)
    assert launched == ["silu_and_mul", "apply_rotary", "write_kv_cache", "paged_attention"]
