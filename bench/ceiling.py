"""This machine's limits, and what they allow a decode step of the model.

Measures memory read bandwidth, the peak rate of the kernels' dot-product instructions
(int8 vpdpbusd, bf16 vdpbf16ps, fp32 fma: what no matmul can beat), and the time of the
model's own weight matmuls (every layer's QKV, output, gate/up and down projections plus
the LM head, i.e. all the FLOPs of a decode step except attention) at each batch size,
with each matmul engine torch offers on this device:

    F.linear      torch's default (MKL on x86 CPUs)
    onednn        oneDNN with the weight prepacked once (what Tandem uses on CPU)
    int8          weight-only int8, float activations: Tandem's --quantization int8 kernel
    int4, int4 bf16   4-bit weights (32-wide groups), fp32 / bf16 activations: --quantization int4
    fbgemm-int8   int8 weights and activations quantized per step (fbgemm; for comparison)
    F.linear bf16, onednn bf16   only where the CPU computes bf16 natively (the engine's default
                  dtype there: onednn bf16 is what it runs without AMX)
    tandem amx bf16   only where the CPU has AMX: Tandem's own kernel (kernels/tandem_kernels/csrc/amx_linear.cpp),
                  what the engine runs there instead of oneDNN
    tandem dot bf16   only where the CPU has AVX-512 BF16 and no AMX: Tandem's own kernel
                  (csrc/bf16_linear.cpp, vdpbf16ps), what the engine runs there instead of oneDNN

The best unquantized torch engine's time is the decode step's ceiling at full
precision, ``batch / time`` tokens/s (the int8 engine's is given apart: it
changes the numbers). This ceiling divided by Tandem's own step time at the same
batch is the "fraction of the ceiling" the performance targets speak of. Where
Tandem's own bf16 kernel runs (AMX, or AVX-512 BF16 dot products), the step is also given
against it ("ratio vs own"): what the step adds to its own matmuls.

    python bench/ceiling.py                    # default model, batches 1,8,32,64,128
    python bench/ceiling.py --batch-sizes 1,32 --json ceiling.json
    python bench/ceiling.py --engine           # also Tandem's own decode step: its ratio to the ceiling
    python bench/ceiling.py --engine --quantization int8
    python bench/ceiling.py --batch-sizes 32,64 --engine --kv-cache-dtype fp8
    python bench/ceiling.py --shapes 2048x2048,2048x8192,2048x512,8192x2048 --batch-sizes 1,8,32,512

``--shapes KxN,...`` times single weight shapes instead of a model's step: for each, the bf16,
int8 and int4 engines in alternating rounds (the best of each), on enough copies of the weight
(512 MB in fp32) that even int4's stream from memory, not from the last-level cache.

With ``--engine`` the step and the best engine's matmuls (and the AMX kernel's) are timed in
alternating rounds in one process (engine_against_ceiling), so the machine's drift cancels out of their ratio. It also gives
the bytes of K and V the step's attention reads, and the ratio a step would reach if it added to
the matmuls only those bytes at the measured bandwidth ("ratio floor"): where attention is bound
by memory, no kernel gets below it without a smaller cache (``--kv-cache-dtype fp8``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median_high

import torch
import torch.nn.functional as F

# Run as a script, bench/ is sys.path[0]: the repository's root goes there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])


def best_time(fn, repeat: int, min_seconds: float = 0.2) -> float:
    """Seconds per call: the best of ``repeat`` rounds (robust to a noisy machine)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds / repeat:
                break
        best = min(best, elapsed / calls)
    return best


def read_bandwidth() -> float:
    """GB/s of a 256 MB reduction (random data: untouched pages would read as zeros from cache)."""
    x = torch.randn(64 * 2 ** 20)
    return x.numel() * 4 / best_time(x.sum, 5, 1.0) / 1e9


def matmul_peak() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048 ** 3 / best_time(lambda: a @ b, 3, 1.0) / 1e9


def dot_peaks() -> dict[str, float]:
    """kind -> G multiply-adds a second that the kernels' dot-product instruction of that kind retires
    on every thread, with nothing else to do (``tandem_kernels.cpu.isa_peak``): what no matmul can
    beat. Kinds the kernel build lacks are left out; empty without the C++ kernels."""
    import tandem_kernels.cpu

    if not tandem_kernels.cpu.available():
        return {}
    peaks = {}
    for kind in tandem_kernels.cpu.ISA_PEAK_KINDS:
        try:
            peaks[kind] = tandem_kernels.cpu.isa_peak(kind, 0.5)
        except RuntimeError:
            continue
    return peaks


def model_shapes(hf_config) -> tuple[list[tuple[int, int]], int]:
    """([(in, out)] of one decoder layer's weight matmuls, number of layers); the LM head apart."""
    c = hf_config
    hidden = c.hidden_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    inter = c.intermediate_size
    layer = [(hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden),
             (hidden, 2 * inter), (inter, hidden)]
    return layer, c.num_hidden_layers


OWN_AMX = "tandem amx bf16"  # Tandem's kernels, not torch's: kept out of the ceiling, timed beside it
OWN_DOT = "tandem dot bf16"
OWN = (OWN_AMX, OWN_DOT)


def engines(dtype_bf16: bool):
    """name -> (prepare(weight [out, in]) -> state, run(x, state)); x is bf16 for the "bf16" engines."""
    out = {
        "F.linear fp32": (lambda w: w, lambda x, w: F.linear(x, w)),
        "onednn fp32": (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 32),
                        lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
    }
    import tandem_kernels.cpu

    if tandem_kernels.cpu.available():
        from backend.models.linear_methods import quantize_int8

        out["int8"] = (quantize_int8, lambda x, qs: tandem_kernels.cpu.int8_linear(x, qs[0], qs[1], None))
        from backend.models.int4_weights import quantize_int4

        out["int4"] = (quantize_int4, lambda x, qs: tandem_kernels.cpu.int4_linear(x, qs[0], qs[1], None))
        if dtype_bf16:
            out["int4 bf16"] = out["int4"]
    if torch.backends.quantized.supported_engines.count("fbgemm"):
        torch.backends.quantized.engine = "fbgemm"

        def pack_int8(w):
            scale = w.abs().amax(1).clamp(min=1e-8) / 127
            q = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
            return torch.ops.quantized.linear_prepack(q, None)

        out["fbgemm-int8"] = (pack_int8, lambda x, p: torch.ops.quantized.linear_dynamic(x, p, True))
    if dtype_bf16:
        out["F.linear bf16"] = (lambda w: w.bfloat16(), lambda x, w: F.linear(x, w))
        out["onednn bf16"] = (lambda w: torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 32),
                              lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
        if tandem_kernels.cpu.amx_available():
            out[OWN_AMX] = (lambda w: (tandem_kernels.cpu.amx_pack_weight(w.bfloat16()), w.shape[0]),
                            lambda x, s: tandem_kernels.cpu.amx_linear(x, s[0], s[1], None))
        elif tandem_kernels.cpu.bf16_dot_available():
            out[OWN_DOT] = (lambda w: (tandem_kernels.cpu.bf16_pack_weight(w.bfloat16()), w.shape[0]),
                            lambda x, s: tandem_kernels.cpu.bf16_dot_linear(x, s[0], s[1], None))
    return out


def engine_against_ceiling(model, quantization, kv_cache_dtype: str, batch: int, context: int,
                           ceiling_step, own_step=None, rounds: int = 8, steps: int = 4) -> dict:
    """Tandem's decode step at ``batch`` sequences of ~``context`` cached tokens, and the ceiling's
    matmul step (``ceiling_step()``), timed in alternating rounds in one process: the machine's
    speed drifts (up to 2x within minutes here), and a ratio of two figures taken minutes apart
    carries that drift. Each round: the ceiling's best of 3 (and ``own_step``'s, Tandem's own
    matmuls, where given), then ``steps`` engine steps. Returns medians and bests of the step, the
    ceiling and their per-round ratio (``own_ms``, ``own_ratio`` likewise), and the mean bytes of K
    and V a step's attention reads (``kv_mb``)."""
    from backend.engine.llm_engine import LLMEngine
    from backend.models.resolve import resolve_config
    from backend.types.config import EngineConfig
    from backend.types.sampling_params import SamplingParams

    config = resolve_config(EngineConfig(model=model, quantization=quantization, max_num_seqs=max(batch, 1),
                          kv_cache_dtype=kv_cache_dtype))
    engine = LLMEngine(config)
    vocab = config.hf_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=rounds * steps + 8, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    for i in range(batch):  # distinct prompts: no prefix sharing
        prompt = torch.randint(100, vocab - 100, (context,), generator=generator).tolist()
        engine.add_request(f"r{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # prefill everyone first
    engine.step()
    step_times, ceiling_times, ratios, cached, own_times, own_ratios = [], [], [], [], [], []
    for _ in range(rounds):
        ceiling = best_time(ceiling_step, 3, 0.0)
        own = best_time(own_step, 3, 0.0) if own_step is not None else None
        times = []
        for _ in range(steps):
            cached.append(sum(r.num_computed_tokens + 1 for r in engine.scheduler.running))
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        ceiling_times.append(ceiling)
        step_times += times
        ratios.append(median_high(times) / ceiling)
        if own is not None:
            own_times.append(own)
            own_ratios.append(median_high(times) / own)
    # The runner's own figure (the cache's dtype, every layer's K and V); this bench runs the uni executor.
    kv_bytes_per_token = engine.executor.worker.runner.kv_bytes_per_block() / config.block_size
    engine.shutdown()
    return {"step_ms": median_high(step_times) * 1e3, "step_best_ms": min(step_times) * 1e3,
            "ceiling_ms": median_high(ceiling_times) * 1e3, "ceiling_best_ms": min(ceiling_times) * 1e3,
            "ratio": median_high(ratios), "ratio_best": min(step_times) / min(ceiling_times),
            "kv_mb": sum(cached) / len(cached) * kv_bytes_per_token / 1e6,
            "own_ms": median_high(own_times) * 1e3 if own_times else None,
            "own_ratio": median_high(own_ratios) if own_ratios else None}


SHAPE_ENGINES = ("F.linear bf16", "onednn bf16", "int8", "int4", "int4 bf16")


def shape_table(shapes: list[tuple[int, int]], batches: list[int], rounds: int = 3) -> list[dict]:
    """ms per matmul of x [batch, K] and a weight [N, K], per engine of SHAPE_ENGINES here: the best
    of ``rounds`` alternating rounds, each weight copy used in turn (512 MB of fp32 copies)."""
    from backend.types.config import cpu_has_native_bf16

    available = engines(cpu_has_native_bf16())
    names = [n for n in SHAPE_ENGINES if n in available]
    print(f"{torch.get_num_threads()} threads; ms per matmul (best of {rounds} alternating rounds)")
    print(f"{'K':>5} {'N':>5} {'M':>4} " + " ".join(f"{n:>13}" for n in names))
    results = []
    for k, n in shapes:
        copies = max(1, -(-512 * 2 ** 20 // (k * n * 4)))
        weights = [torch.randn(n, k) * k ** -0.5 for _ in range(copies)]
        states = {name: [available[name][0](w) for w in weights] for name in names}
        del weights
        for batch in batches:
            x = torch.randn(batch, k)
            best = {name: float("inf") for name in names}
            for _ in range(rounds):
                for name in names:
                    run, xs, ws = available[name][1], x.bfloat16() if "bf16" in name else x, states[name]
                    position = iter(range(10 ** 9))

                    def one():
                        run(xs, ws[next(position) % copies])
                    best[name] = min(best[name], best_time(one, 1, 0.3))
            results.append({"k": k, "n": n, "m": batch, "ms": {name: t * 1e3 for name, t in best.items()}})
            print(f"{k:>5} {n:>5} {batch:>4} " + " ".join(f"{best[name] * 1e3:>13.3f}" for name in names), flush=True)
        del states
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--batch-sizes", default="1,8,32,64,128")
    parser.add_argument("--engine", action="store_true", help="also time Tandem's decode step at each batch")
    parser.add_argument("--quantization", default=None, help="the engine's --quantization (with --engine)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype (with --engine)")
    parser.add_argument("--context", type=int, default=200, help="tokens cached per sequence (with --engine)")
    parser.add_argument("--shapes", help="KxN,...: time these weight shapes instead of a model's step")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.shapes:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
        table = shape_table(shapes, [int(b) for b in args.batch_sizes.split(",")])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(table, f, indent=2)
        return

    import warnings

    from backend.models.resolve import resolve_config
    from backend.types.config import EngineConfig, cpu_has_native_bf16

    warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")
    config = resolve_config(EngineConfig(model=args.model))
    layer, num_layers = model_shapes(config.hf_config)
    vocab, hidden = config.hf_config.vocab_size, config.hf_config.hidden_size
    params = num_layers * sum(i * o for i, o in layer) + vocab * hidden
    print(f"{config.served_model_name}: {num_layers} layers, {params / 1e6:.1f} M matmul weights; "
          f"{torch.get_num_threads()} threads")
    bandwidth, peak = read_bandwidth(), matmul_peak()
    print(f"memory read bandwidth {bandwidth:.1f} GB/s; fp32 matmul 2048^3 {peak:.0f} GFLOP/s")
    peaks = dot_peaks()
    if peaks:
        print("dot-product instruction peaks, G multiply-adds/s on every thread (no matmul reaches them): "
              + ", ".join(f"{kind} {rate:.0f}" for kind, rate in peaks.items()))

    results = {"bandwidth_gbs": bandwidth, "fp32_gflops": peak, "dot_peaks_gmacs": peaks, "params": params,
               "steps": []}
    torch.manual_seed(0)
    # Every layer's own weights, as in the model: the step streams them all from memory (one
    # layer's would stay in the CPU's cache and time far faster than a real step).
    weights = [torch.randn(o, i) * i ** -0.5 for _ in range(num_layers) for i, o in layer]
    weights.append(torch.randn(vocab, hidden) * 0.05)  # the LM head
    names = list(engines(cpu_has_native_bf16()))
    print("\nweight matmuls of one decode step, ms (best engine -> ceiling tok/s)")
    print(f"{'batch':>5} " + " ".join(f"{n:>15}" for n in names) + f" {'ceiling tok/s':>14} {'int8':>6}")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        row = {}
        for name, (prepare, run) in engines(cpu_has_native_bf16()).items():
            states = [prepare(w) for w in weights]
            dtype = torch.bfloat16 if "bf16" in name else torch.float32  # activations as the engine has them
            inputs = {w.shape[1]: torch.randn(batch, w.shape[1]).to(dtype) for w in weights}

            def step():
                for w, state in zip(weights, states):
                    run(inputs[w.shape[1]], state)

            row[name] = best_time(step, 3, 1.0)
            del states
        best = min((n for n in row if "int8" not in n and "int4" not in n and n not in OWN), key=row.get)
        int8 = batch / row["int8"] if "int8" in row else float("nan")
        results["steps"].append({"batch": batch, "ms": {k: v * 1e3 for k, v in row.items()}, "best": best,
                                 "ceiling_tok_s": batch / row[best], "ceiling_int8_tok_s": int8})
        print(f"{batch:>5} " + " ".join(f"{row[n] * 1e3:>15.1f}" for n in names)
              + f" {batch / row[best]:>14.0f} {int8:>6.0f}")
    floor = params * 4 / bandwidth / 1e9
    print(f"\nbatch-1 bandwidth floor: fp32 weights {floor * 1e3:.1f} ms/step ({1 / floor:.0f} tok/s), "
          f"int8 {floor / 4 * 1e3:.1f} ms ({4 / floor:.0f} tok/s)")
    if args.engine:
        print(f"\nTandem's decode step ({args.quantization or config.torch_dtype_name} weights, KV cache "
              f"{args.kv_cache_dtype}, {args.context} tokens cached per sequence) and the ceiling's matmul step, "
              f"timed in alternating rounds: ms, and the step's ratio to the ceiling (target <= 1.4 at batch 32)")
        print("(KV MB: what a step's attention reads; ratio floor: (ceiling + those bytes at the measured "
              "bandwidth) / ceiling, the best ratio a step could reach)")
        available = engines(cpu_has_native_bf16())
        own = next((n for n in OWN if n in available), None) if args.quantization is None else None
        if own:
            print(f"(own ms, ratio vs own: the same for {own}, the matmuls this engine runs here)")
        print(f"{'batch':>5} {'step median':>12} {'best':>6} {'ceiling median':>15} {'best':>6} {'tok/s':>7} "
              f"{'ratio (median of rounds)':>25} {'best / best':>12} {'KV MB':>7} {'ratio floor':>12}"
              + (f" {'own ms':>7} {'ratio vs own':>13}" if own else ""))

        def matmul_step(name: str, batch: int):
            """The step's weight matmuls on engine ``name``, weights prepared once."""
            prepare, run = available[name]
            states = [prepare(w) for w in weights]
            x_dtype = torch.bfloat16 if "bf16" in name else torch.float32
            inputs = {w.shape[1]: torch.randn(batch, w.shape[1]).to(x_dtype) for w in weights}

            def step():
                for w, state in zip(weights, states):
                    run(inputs[w.shape[1]], state)
            return step

        for step in results["steps"]:
            quantized = {"int8": "int8", "int4": "int4 bf16" if config.torch_dtype_name == "bfloat16" else "int4"}
            name = quantized.get(args.quantization, step["best"])
            found = engine_against_ceiling(args.model, args.quantization, args.kv_cache_dtype, step["batch"],
                                           args.context, matmul_step(name, step["batch"]),
                                           matmul_step(own, step["batch"]) if own else None)
            step["engine"] = found
            print(f"{step['batch']:>5} {found['step_ms']:>12.1f} {found['step_best_ms']:>6.1f} "
                  f"{found['ceiling_ms']:>15.1f} {found['ceiling_best_ms']:>6.1f} "
                  f"{step['batch'] / found['step_ms'] * 1e3:>7.0f} {found['ratio']:>25.2f} {found['ratio_best']:>12.2f} "
                  f"{found['kv_mb']:>7.0f} {1 + found['kv_mb'] / bandwidth / found['ceiling_ms']:>12.2f}"
                  + (f" {found['own_ms']:>7.1f} {found['own_ratio']:>13.2f}" if own else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
