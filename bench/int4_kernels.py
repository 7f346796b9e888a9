"""The 4-bit CPU kernel on one layer, with fp16 (d, m) per 32-wide group (int4: Q4_0, Q4_1) and with
float32 ones (int4f: Q4_K, AWQ, GPTQ), the grouped int8 kernel (int8g: Q5_K, Q6_K, Q8_0; one
code a weight, float32 (s, m) per 16) and, against int8 activations (``--int4-activations int8``),
the 4-bit weights (``int4_q8_linear``) and the grouped int8 ones with 6-bit codes (``int8g_q8_linear``),
against F.linear on the weights in x's dtype (bf16 or float32).

    python bench/int4_kernels.py [--n 4096] [--k 2048] [--rows 1,4,32] [--repeats 20] [--dtype bfloat16]
    python bench/int4_kernels.py --n 8192 --k 2048 --rows 1 --layers 16   # weights from memory

Prints the best time of ``--repeats`` calls after 3 warm-up calls, per kernel and row count, in ms
per layer. With ``--layers L`` each kernel runs over L layers' weights in turn (each drawn apart),
so that for L large enough the weights come from memory rather than cache, as in a model's
decode step; it then also prints the rate each kernel read its weights at (GB/s)."""

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


def layer_kernels(n: int, k: int, dtype: torch.dtype, seed: int) -> dict[str, tuple]:
    """One layer's weights in every layout: kernel name -> (call on x [M, K], weight bytes)."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02  # [N, K]
    qweight, scales16 = quantize_int4(weight)  # [N, K / 2] uint8, [N, K / 32, 2] fp16
    scales32, weight_x = scales16.float(), weight.to(dtype)
    codes8, scales8 = int8g_weights(weight)
    codes4, dm4 = gguf_reference.pack_int4_q8(qweight, scales16)  # int4_q8_linear's layout
    codes_q8, scales_q8 = gguf_reference.pack_int8g_q8(codes8, scales8)  # int8g_q8_linear's
    scales_q8 = scales_q8.half()

    def size(*tensors: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)
    return {
        f"F.linear {str(dtype).removeprefix('torch.')}": (lambda x: F.linear(x, weight_x), size(weight_x)),
        "int4 (fp16 d,m)": (lambda x: cpu.int4_linear(x, qweight, scales16, None), size(qweight, scales16)),
        "int4f (fp32 d,m)": (lambda x: cpu.int4_linear(x, qweight, scales32, None), size(qweight, scales32)),
        "int8g (fp32 s,m)": (lambda x: cpu.gguf_int8g_linear(x, codes8, scales8, None), size(codes8, scales8)),
        "int4 x int8 (fp16 d,m)": (lambda x: cpu.int4_q8_linear(x, codes4, dm4, n, None), size(codes4, dm4)),
        "int8g x int8 (fp16 s,m)": (lambda x: cpu.int8g_q8_linear(x, codes_q8, scales_q8, n, None),
                                    size(codes_q8, scales_q8)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--rows", default="1,4,32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="x's dtype")
    parser.add_argument("--layers", type=int, default=1, help="layers' weights each kernel runs over in turn")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error("--layers must be at least 1")
    if not cpu.available():
        raise SystemExit(f"the fused CPU kernels are not available: {cpu.unavailable_reason()}")
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    layers = [layer_kernels(args.n, args.k, dtype, seed) for seed in range(args.layers)]
    print(f"{cpu.loaded_library()[1].name} build, N={args.n} K={args.k}, {args.dtype} x, {args.layers} layer(s), "
          f"best of {args.repeats} (ms per layer{'; GB/s of weights' if args.layers > 1 else ''})")
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, args.k).to(dtype)  # [M, K]
        cells = []
        for name in layers[0]:
            calls = [layer[name][0] for layer in layers]
            ms = best_ms(lambda: [call(x) for call in calls], args.repeats)
            rate = f" ({sum(layer[name][1] for layer in layers) / ms / 1e6:.1f})" if args.layers > 1 else ""
            cells.append(f"{name} {ms / args.layers:.2f}{rate}")
        print(f"M={m}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
