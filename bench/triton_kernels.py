"""Each Triton kernel against its torch reference: error, time, achieved bandwidth.

Decode attention runs at (batch, context) points on a paged cache with scattered
blocks; its reference is kernels/tandem_kernels/reference.py's path (gather the blocks, then
``scaled_dot_product_attention``). The element-wise kernels (fused add + RMSNorm,
rotary, KV-cache write) run at batch tokens. Bandwidth is the bytes a kernel must
move (read + write, no re-reads) over its time, and a fraction of the device's
copy bandwidth (measured here, or given with --bandwidth-gbs).

    python bench/triton_kernels.py                      # the Llama-3.2-1B shape, bf16, on CUDA
    python bench/triton_kernels.py --tiny               # CPU, Triton's interpreter, tiny shapes

On CUDA a kernel is timed inside a CUDA graph (no launch overhead); on the CPU
(interpreter) by wall clock: those numbers only prove the script runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script, bench/ is sys.path[0]: the repository's root goes there
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    if "--tiny" in sys.argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from tandem_kernels import reference as R

POINTS = [(1, 1024), (1, 8192), (64, 1024), (256, 1024), (256, 4096)]
TINY_POINTS = [(1, 40), (3, 130)]
LLAMA_1B = dict(heads=32, kv_heads=8, head_dim=64, hidden=2048)
TINY_SHAPE = dict(heads=4, kv_heads=2, head_dim=16, hidden=64)


def time_us(fn, device: torch.device) -> float:
    """Mean microseconds per call: in a CUDA graph on CUDA (eager events if the op
    cannot be captured); by wall clock elsewhere."""
    if device.type == "cuda":
        import triton.testing

        try:
            return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3
        except RuntimeError:
            torch.cuda.synchronize()
            return triton.testing.do_bench(fn, warmup=5, rep=20) * 1e3
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def copy_bandwidth_gbs(device: torch.device, num_bytes: int) -> float:
    """Device-to-device copy rate, counting read + write."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / (time_us(lambda: dst.copy_(src), device) * 1e-6) / 1e9


def read_bandwidth_gbs(device: torch.device, num_bytes: int) -> float:
    """Device read rate: a sum over num_bytes of bf16 (decode reads far more than it writes)."""
    src = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device=device)
    return num_bytes / (time_us(lambda: src.sum(dtype=torch.float32), device) * 1e-6) / 1e9


def memory_bandwidth_gbs(device: torch.device, num_bytes: int) -> float:
    """The 100 % of every bandwidth figure: the better of the copy and the read rates."""
    return max(copy_bandwidth_gbs(device, num_bytes), read_bandwidth_gbs(device, num_bytes))


def decode_case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A decode batch over a random paged cache whose blocks are handed out in random order."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = R.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=g, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=g, device=device).view(batch, blocks_per_seq)
    query = torch.randn(batch, heads, head_dim, generator=g, device=device, dtype=dtype)
    seq_lens, query_lens = [context] * batch, [1] * batch
    return (query, k_cache, v_cache, R.plan_varlen(tables, seq_lens, query_lens),
            R.plan_attention(tables, seq_lens, query_lens, block_size))


def bench_attention(points, shape: dict, dtype: torch.dtype, device: torch.device, bandwidth_gbs: float,
                    block_size: int = 16) -> list[dict]:
    from tandem_kernels import attention

    rows = []
    for batch, context in points:
        query, k_cache, v_cache, varlen, plan = decode_case(batch, context, shape["heads"], shape["kv_heads"],
                                                            shape["head_dim"], block_size, dtype, device)
        scale = shape["head_dim"] ** -0.5
        none = query[:0]  # key/value of the step: unused on the decode path (read from the caches)
        run = lambda: attention.paged_attention(query, none, none, k_cache, v_cache, varlen, scale)  # noqa: E731
        ref = lambda: R.paged_attention(query, none, none, k_cache, v_cache, plan, scale)  # noqa: E731
        error = (run().float() - ref().float()).abs().max().item()
        kv_bytes = 2 * batch * context * shape["kv_heads"] * shape["head_dim"] * k_cache.element_size()
        moved = kv_bytes + 2 * query.numel() * query.element_size()
        rows.append(_row("paged_attention", f"{batch}x{context}", error, time_us(run, device),
                         time_us(ref, device), moved, bandwidth_gbs,
                         splits=attention.split_layout(varlen, shape["kv_heads"], device)[0]))
    return rows


def bench_elementwise(batches, shape: dict, dtype: torch.dtype, device: torch.device,
                      bandwidth_gbs: float, block_size: int = 16) -> list[dict]:
    from tandem_kernels import cache_ops, norms, rotary

    g = torch.Generator(device=device).manual_seed(0)
    heads, kvh, d, hidden = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["hidden"]
    rows = []
    for tokens in batches:
        rand = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
        x, residual, weight = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
        got, _ = norms.fused_add_rms_norm(x, residual, weight, 1e-5)
        error = (got.float() - R.fused_add_rms_norm(x, residual, weight, 1e-5)[0].float()).abs().max().item()
        rows.append(_row("fused_add_rms_norm", f"{tokens} tok", error,
                         time_us(lambda: norms.fused_add_rms_norm(x, residual, weight, 1e-5), device),
                         time_us(lambda: R.fused_add_rms_norm(x, residual, weight, 1e-5), device),
                         4 * x.numel() * x.element_size(), bandwidth_gbs))

        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
        cos_sin = R.rotary_cos_sin(inv_freq.cpu(), 4096).to(device)
        positions = torch.randint(0, 4096, (tokens,), generator=g, device=device)
        qkv = rand(tokens, (heads + 2 * kvh) * d)
        q, k, _ = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
        want_q, _ = R.apply_rotary(positions, q, k, cos_sin, d)
        rotary.apply_rotary(positions, q, k, cos_sin, d)  # in place, once: compare
        error = (q.float() - want_q.float()).abs().max().item()
        rows.append(_row("apply_rotary", f"{tokens} tok", error,
                         time_us(lambda: rotary.apply_rotary(positions, q, k, cos_sin, d), device),
                         time_us(lambda: R.apply_rotary(positions, q, k, cos_sin, d), device),
                         2 * (q.numel() + k.numel()) * q.element_size(), bandwidth_gbs))

        num_blocks = -(-tokens // block_size) + 1
        caches = [torch.zeros(R.kv_cache_shape(num_blocks, block_size, kvh, d), device=device, dtype=dtype)
                  for _ in range(4)]
        slots = torch.randperm(num_blocks * block_size, generator=g, device=device)[:tokens]
        key, value = rand(tokens, kvh, d), rand(tokens, kvh, d)
        cache_ops.write_kv_cache(key, value, caches[0], caches[1], slots)
        R.write_kv_cache(key, value, caches[2], caches[3], slots)
        error = max((caches[0] - caches[2]).abs().max().item(), (caches[1] - caches[3]).abs().max().item())
        rows.append(_row("write_kv_cache", f"{tokens} tok", error,
                         time_us(lambda: cache_ops.write_kv_cache(key, value, caches[0], caches[1], slots), device),
                         time_us(lambda: R.write_kv_cache(key, value, caches[2], caches[3], slots), device),
                         4 * key.numel() * key.element_size(), bandwidth_gbs))
    return rows


def _row(kernel: str, point: str, error: float, us: float, ref_us: float, moved: int,
         bandwidth_gbs: float, **extra) -> dict:
    gbs = moved / (us * 1e-6) / 1e9
    return dict(kernel=kernel, point=point, max_abs_err=error, triton_us=us, torch_us=ref_us,
                speedup=ref_us / us, gb_per_s=gbs, pct_bandwidth=100 * gbs / bandwidth_gbs, **extra)


def format_table(rows: list[dict]) -> str:
    lines = ["| kernel | point | max abs err | Triton µs | torch µs | speed-up | GB/s | % of copy BW |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['point']} | {r['max_abs_err']:.2e} | {r['triton_us']:.1f} | "
                     f"{r['torch_us']:.1f} | {r['speedup']:.2f}x | {r['gb_per_s']:.0f} | {r['pct_bandwidth']:.0f}% |")
    return "\n".join(lines)


def run(tiny: bool, bandwidth_gbs: float | None = None) -> tuple[float, list[dict]]:
    """(memory GB/s used as 100 %, rows): the decode points, then the element-wise kernels."""
    device = torch.device("cpu" if tiny else "cuda")
    shape = TINY_SHAPE if tiny else LLAMA_1B
    dtype = torch.bfloat16
    if bandwidth_gbs is None:
        bandwidth_gbs = memory_bandwidth_gbs(device, 8 << 20 if tiny else 1 << 30)
    points = TINY_POINTS if tiny else POINTS
    rows = bench_attention(points, shape, dtype, device, bandwidth_gbs)
    rows += bench_elementwise(sorted({b for b, _ in points}), shape, dtype, device, bandwidth_gbs)
    return bandwidth_gbs, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    parser.add_argument("--bandwidth-gbs", type=float, help="the 100%% mark (default: measured copy rate)")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --tiny)")
    bandwidth, rows = run(args.tiny, args.bandwidth_gbs)
    print(f"copy bandwidth (100 %): {bandwidth:.0f} GB/s")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
