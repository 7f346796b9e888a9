"""The w8a8 CPU kernels on one layer: ``w8a8_linear`` on the plain int8 weight against
``w8a8_linear_packed`` on its panels (the one the engine runs: AVX-512 VNNI, AVX2 or plain loops,
whichever this build has), with F.linear on the float weight beside them.

    python bench/w8a8_kernels.py [--n 8192] [--k 2048] [--rows 1,4,32,128] [--repeats 10] [--dtype float32]

Prints the best time of ``--repeats`` calls after 2 warm-up calls, per kernel and row count, each row
count's kernels timed in turn within each repeat (so a change in the machine's speed touches all)."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import tandem_kernels.cpu as cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--rows", default="1,4,32,128")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32", help="x's dtype")
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit(f"the fused CPU kernels are not available: {cpu.unavailable_reason()}")
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weight = torch.randint(-127, 128, (args.n, args.k), dtype=torch.int8)  # [N, K]
    scale = torch.rand(args.n) * 0.01  # [N]
    packed = cpu.w8a8_pack_weight(weight)
    weight_x = (weight.float() * scale.unsqueeze(1)).to(dtype)
    kernel = "AVX-512 VNNI" if cpu.w8a8_vnni_available() else "no VNNI"
    level = cpu.loaded_library()[1].name
    print(f"{level} build ({kernel}), N={args.n} K={args.k}, {args.dtype} x, best of {args.repeats} (ms)")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.k).to(dtype)  # [M, K]
        calls = {"F.linear": lambda: F.linear(x, weight_x),
                 "w8a8 plain weight": lambda: cpu.w8a8_linear(x, weight, scale, None),
                 "w8a8 packed": lambda: cpu.w8a8_linear_packed(x, packed, scale, None)}
        for call in calls.values():
            call(), call()
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(args.repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
        ops = 2 * rows * args.n * args.k
        print(f"M={rows}: " + "  ".join(f"{name} {t * 1e3:.2f} ({ops / t / 1e9:.0f} GOPS)" for name, t in best.items()))


if __name__ == "__main__":
    main()
