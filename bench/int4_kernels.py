"""The 4-bit CPU kernel on one layer, with fp16 (d, m) per 32-wide group (int4: Q4_0, Q4_1) and with
float32 ones (int4f: Q4_K, AWQ, GPTQ), the grouped int8 kernel (int8g: Q5_K, Q6_K, Q8_0; one
code a weight, float32 (s, m) per 16) and, against int8 activations (``--int4-activations int8``),
the 4-bit weights (``int4_q8_linear``) and the grouped int8 ones with 6-bit codes (``int8g_q8_linear``),
against F.linear on the weights in x's dtype (bf16 or float32).

    python bench/int4_kernels.py [--n 4096] [--k 2048] [--rows 1,4,32] [--repeats 20] [--dtype bfloat16]

Prints the best time of ``--repeats`` calls after 3 warm-up calls, per kernel and row count."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import tandem_kernels.cpu as cpu
from tandem_kernels import gguf_reference
from backend.models.int4_weights import quantize_int4


def best_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def int8g_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] in the grouped int8 layout with Q6_K's 6-bit codes: codes [N, K] int8 in
    [-31, 31], (s, m) [N, K / 16, 2] float32 (symmetric, m = 0: the kernels' cost does not depend on
    the values)."""
    groups = weight.view(weight.shape[0], -1, 16)  # [N, K / 16, 16]
    s = groups.abs().amax(dim=2).clamp_min(1e-8) / 31  # [N, K / 16]
    codes = torch.round(groups / s.unsqueeze(2)).to(torch.int8).view_as(weight)
    return codes, torch.stack([s, torch.zeros_like(s)], dim=2).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--rows", default="1,4,32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="x's dtype")
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit(f"the fused CPU kernels are not available: {cpu.unavailable_reason()}")
    torch.manual_seed(0)
    weight = torch.randn(args.n, args.k) * 0.02  # [N, K]
    qweight, scales16 = quantize_int4(weight)  # [N, K / 2] uint8, [N, K / 32, 2] fp16
    dtype = getattr(torch, args.dtype)
    scales32, weight_x = scales16.float(), weight.to(dtype)
    codes8, scales8 = int8g_weights(weight)
    panels = (*gguf_reference.pack_int4_q8(qweight, scales16), args.n)  # int4_q8_linear's layout
    codes_q8, scales_q8 = gguf_reference.pack_int8g_q8(codes8, scales8)  # int8g_q8_linear's
    panels8 = (codes_q8, scales_q8.half(), args.n)
    print(f"{cpu.loaded_library()[1].name} build, N={args.n} K={args.k}, {args.dtype} x, best of {args.repeats} (ms)")
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, args.k).to(dtype)  # [M, K]
        row = {f"F.linear {args.dtype}": best_ms(lambda: F.linear(x, weight_x), args.repeats),
               "int4 (fp16 d,m)": best_ms(lambda: cpu.int4_linear(x, qweight, scales16, None), args.repeats),
               "int4f (fp32 d,m)": best_ms(lambda: cpu.int4_linear(x, qweight, scales32, None), args.repeats),
               "int8g (fp32 s,m)": best_ms(lambda: cpu.gguf_int8g_linear(x, codes8, scales8, None), args.repeats),
               "int4 x int8 (fp16 d,m)": best_ms(lambda: cpu.int4_q8_linear(x, *panels, None), args.repeats),
               "int8g x int8 (fp16 s,m)": best_ms(lambda: cpu.int8g_q8_linear(x, *panels8, None), args.repeats)}
        print(f"M={m}: " + "  ".join(f"{name} {ms:.2f}" for name, ms in row.items()))


if __name__ == "__main__":
    main()
