"""What a decode step's memory traffic costs when its two streams share the caches.

A decode step at batch 32 streams every weight once (the default model: 270 MB in bf16) and every
sequence's K and V once (~160 MB at 200 tokens each); together they are more than this machine's
caches hold, so each is read at the rate of memory, not of the L3 that a benchmark of one of
them alone may partly hit. This script times, on the default model's shapes:

  1. paged attention alone (tandem_kernels.cpu.paged_attention) over 10 to 120 layers' caches: its rate
     as the working set grows past the caches;
  2. attention and the layer's matmuls (the engine's matmul kernel for bf16 on this CPU) alone,
     then interleaved layer by layer as in a step, with each kind's own time in the interleaved
     run; and the same with a plain reduction of the layer's weight bytes in place of the
     matmuls (memory traffic without the matmul units).

    python bench/working_set.py                    # batch 32, 200 tokens a sequence
    python bench/working_set.py --batch 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# Run as a script, bench/ is sys.path[0]: the repository's root goes there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate/up, down (out, in)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def best_ms(fn, repeat: int = 8) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def matmul_kernel():
    """(prepare(weight [out, in] fp32) -> state, run(x bf16, state)): Tandem's bf16 matmul here."""
    import tandem_kernels.cpu

    if tandem_kernels.cpu.amx_available():
        return (lambda w: (tandem_kernels.cpu.amx_pack_weight(w.bfloat16()), w.shape[0]),
                lambda x, s: tandem_kernels.cpu.amx_linear(x, s[0], s[1], None))
    return (lambda w: torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 32),
            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=200, help="tokens cached per sequence")
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()

    import tandem_kernels.cpu

    if not tandem_kernels.cpu.available():
        sys.exit(f"the CPU kernels are unavailable: {tandem_kernels.cpu.unavailable_reason()}")
    torch.manual_seed(0)
    batch, context, layers = args.batch, args.context, args.layers
    blocks = -(-context // BLOCK)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)  # each sequence's blocks adjacent
    lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
    shape = (batch * blocks, KV_HEADS, BLOCK, HEAD_DIM)
    caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(4 * layers)]
    kv_mb = batch * context * KV_HEADS * HEAD_DIM * 2 * 2 / 1e6  # one layer's K and V, bf16

    def attend(k, v):
        tandem_kernels.cpu.paged_attention(query, k, v, tables, lens, starts, HEAD_DIM ** -0.5)

    print(f"paged attention alone, batch {batch} x {context} tokens ({kv_mb:.1f} MB of K and V a layer)")
    for n in (layers // 3, layers, 2 * layers, 4 * layers):
        ms = best_ms(lambda: [attend(k, v) for k, v in caches[:n]])
        print(f"  {n:4d} layers' caches ({n * kv_mb:5.0f} MB): {ms / n * 1e3:6.0f} us a layer, "
              f"{n * kv_mb / ms:5.1f} GB/s")

    prepare, run = matmul_kernel()
    weights = [[prepare(torch.randn(o, i) * i ** -0.5) for o, i in LAYER] for _ in range(layers)]
    inputs = {i: torch.randn(batch, i).bfloat16() for _, i in LAYER}
    weight_mb = sum(o * i for o, i in LAYER) * 2 / 1e6
    sweeps = [torch.randn(int(weight_mb * 1e6) // 4) for _ in range(layers)]  # the same bytes, fp32
    step_caches = caches[:layers]

    def matmuls(layer: int) -> None:
        for (_, i), state in zip(LAYER, weights[layer]):
            run(inputs[i], state)

    def interleaved(other) -> tuple[float, float]:
        """(attention ms, other ms) of one pass over the layers, each layer: other, then attention."""
        spent = [0.0, 0.0]
        for layer, (k, v) in enumerate(step_caches):
            start = time.perf_counter()
            other(layer)
            middle = time.perf_counter()
            attend(k, v)
            spent[0] += time.perf_counter() - middle
            spent[1] += middle - start
        return spent[0] * 1e3, spent[1] * 1e3

    print(f"\n{layers} layers as in a step: attention ({layers * kv_mb:.0f} MB) and each layer's "
          f"{weight_mb:.1f} MB of weights, ms")
    print(f"  {'other work':<22} {'attention alone':>16} {'other alone':>12} {'attention interleaved':>22} "
          f"{'other interleaved':>18}")
    for name, other in (("matmuls (engine's)", matmuls), ("reduction, same bytes", lambda l: sweeps[l].sum())):
        alone_attention = best_ms(lambda: [attend(k, v) for k, v in step_caches])
        alone_other = best_ms(lambda: [other(layer) for layer in range(layers)])
        runs = sorted(interleaved(other) for _ in range(8))
        attention_ms, other_ms = runs[len(runs) // 2]
        print(f"  {name:<22} {alone_attention:16.2f} {alone_other:12.2f} {attention_ms:22.2f} {other_ms:18.2f}")


if __name__ == "__main__":
    main()
