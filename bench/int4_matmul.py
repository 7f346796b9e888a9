"""The Triton int4 dequant-GEMM (kernels/tandem_kernels/int4_matmul.py) at a model's linear shapes:
its error against the plain-torch twin, its time against torch's matmul on the same weights
dequantized to x's dtype (what the model runs without quantization), and the rate at which it reads
the packed weights (4.5 bits a weight with fp16 scales) as a share of the device's memory bandwidth.

    python bench/int4_matmul.py                 # Llama-3.2-1B's four linears, bf16, on CUDA
    python bench/int4_matmul.py --tiny          # CPU, Triton's interpreter, tiny shapes (proves it runs)

On CUDA each call is timed inside a CUDA graph (bench/triton_kernels.py's timer). Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script, bench/ is sys.path[0]: the repository's root goes there
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    if "--tiny" in sys.argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from bench.triton_kernels import memory_bandwidth_gbs, time_us
from tandem_kernels import reference as R

# (name, N, K) of Llama-3.2-1B's linears (q|k|v, o, gate|up, down)
LLAMA_1B = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)]
TINY = [("tiny", 80, 96)]
ROWS, TINY_ROWS = (1, 16, 64, 512), (1, 5)


def bench(layers, row_counts, dtype: torch.dtype, device: torch.device, bandwidth_gbs: float) -> list[dict]:
    from backend.models.int4_weights import quantize_int4
    from tandem_kernels import int4_matmul

    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, n, k in layers:
        qweight, scales = quantize_int4(torch.randn(n, k, generator=g, device=device))
        dense = R.int4_dequantize(qweight, scales).to(dtype)  # [N, K]
        for m in row_counts:
            x = torch.randn(m, k, generator=g, device=device).to(dtype)
            got = int4_matmul.int4_linear(x, qweight, scales, None)
            error = (got.float() - R.int4_linear(x, qweight, scales, None).float()).abs().max().item()
            us = time_us(lambda: int4_matmul.int4_linear(x, qweight, scales, None), device)
            dense_us = time_us(lambda: F.linear(x, dense), device)
            moved = qweight.numel() + scales.numel() * scales.element_size() + (x.numel() + m * n) * x.element_size()
            gbs = moved / (us * 1e-6) / 1e9
            rows.append(dict(layer=f"{name} {n}x{k}", rows=m, max_abs_err=error, int4_us=us, dense_us=dense_us,
                             speedup=dense_us / us, gb_per_s=gbs, pct_bandwidth=100 * gbs / bandwidth_gbs))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| layer (N x K) | rows | max abs err | int4 µs | dense µs | int4 speed-up | GB/s | % of BW |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['rows']} | {r['max_abs_err']:.2e} | {r['int4_us']:.1f} | "
                     f"{r['dense_us']:.1f} | {r['speedup']:.2f}x | {r['gb_per_s']:.0f} | {r['pct_bandwidth']:.0f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --tiny)")
    device = torch.device("cpu" if args.tiny else "cuda")
    bandwidth = memory_bandwidth_gbs(device, 8 << 20 if args.tiny else 1 << 30)
    rows = bench(TINY if args.tiny else LLAMA_1B, TINY_ROWS if args.tiny else ROWS, getattr(torch, args.dtype),
                 device, bandwidth)
    print(f"memory bandwidth (100 %): {bandwidth:.0f} GB/s; dense = F.linear on the dequantized weights")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
