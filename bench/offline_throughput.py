"""Offline throughput: Tandem's ``LLM.generate`` against HF transformers ``generate``, in one run.

Same model, same prompts (~128 tokens each), the same number of forced output
tokens (greedy, EOS ignored). HF runs at each batch size and dtype given and
its best counts. Prints output tokens/s of both and the ratio. Every run is a
fresh subprocess, so no run inherits another's threads or memory.

    python bench/offline_throughput.py                      # default model, 64 x 128
    python bench/offline_throughput.py --hf-batch-sizes 32,64 --hf-dtypes bfloat16
    python bench/offline_throughput.py --executor mp --skip-hf   # the mp executor's IPC cost vs uni
    python bench/offline_throughput.py --quantization int4 --skip-hf --num-prompts 32

``--quantization int4`` (or any list) adds a run of the same engine with those weights next to the
plain one and prints their ratio (e.g. bf16 against int4 weights at the same batch).

``--executor mp`` adds a run with one worker process (TP=1) next to the in-process ``uni`` run
and prints their ratio: what the per-step messages to a worker process cost.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# Run as a script, bench/ is sys.path[0]: the repository's root goes there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.prompts import document  # noqa: E402


def make_prompts(tokenizer, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """num_prompts distinct token-ID prompts of exactly prompt_len tokens."""
    prompts = []
    for i in range(num_prompts):
        text = document(i, 12)
        ids = tokenizer.encode(text)
        assert len(ids) >= prompt_len, "make the prompt text longer"
        prompts.append(ids[:prompt_len])
    return prompts


def bench_tandem(model, prompts, output_len: int, executor: str = "uni", **engine_kwargs) -> dict:
    from frontend import LLM, SamplingParams

    llm = LLM(model=model, distributed_executor_backend=executor, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == len(prompts) * output_len
    llm.shutdown()
    name = "tandem" if executor == "uni" else f"tandem-{executor}"
    if engine_kwargs.get("quantization"):
        name += f"-{engine_kwargs['quantization']}"
    return {"name": name, "dtype": llm.engine.engine.config.torch_dtype_name,
            "seconds": elapsed, "tokens": num_tokens, "tok_per_s": num_tokens / elapsed}


def bench_hf(model_dir, prompts, output_len: int, batch_size: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    num_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]  # equal lengths: no padding needed
            ids = torch.tensor(batch)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=model.config.eos_token_id)
            num_tokens += (out.shape[1] - ids.shape[1]) * len(batch)
    elapsed = time.perf_counter() - start
    return {"name": f"hf-bs{batch_size}", "dtype": dtype, "seconds": elapsed, "tokens": num_tokens,
            "tok_per_s": num_tokens / elapsed}


def run_one(args: argparse.Namespace) -> dict:
    """One measurement in this process: ``--run tandem`` or ``--run hf:BATCH:DTYPE``."""
    from backend.models.resolve import resolve_config
    from backend.types.config import EngineConfig
    from frontend.tokenizer import load_tokenizer

    config = resolve_config(EngineConfig(model=args.model))
    prompts = make_prompts(load_tokenizer(str(config.tokenizer_path)), args.num_prompts, args.prompt_len)
    if args.run.startswith("tandem"):  # tandem[:EXECUTOR[:QUANTIZATION]]
        _, executor, quantization = (args.run.split(":") + ["", ""])[:3]
        return bench_tandem(args.model, prompts, args.output_len, executor or "uni", dtype=args.dtype,
                            quantization=quantization or None)
    _, batch_size, dtype = args.run.split(":")
    return bench_hf(config.model_path, prompts, args.output_len, int(batch_size), dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-sizes", default="32,64")
    parser.add_argument("--hf-dtypes", default="bfloat16,float32")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--dtype", default="auto", help="Tandem's dtype")
    parser.add_argument("--executor", default="uni",
                        help="Tandem's executors to run, comma-separated; uni always runs (default: uni)")
    parser.add_argument("--quantization", default="",
                        help="comma-separated: also run Tandem with each of these --quantization settings")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: one measurement, JSON on stdout
    args = parser.parse_args()

    if args.run:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return

    runs = ["tandem"] + [f"tandem:{e}" for e in args.executor.split(",") if e and e != "uni"]
    runs += [f"tandem:uni:{q}" for q in args.quantization.split(",") if q]
    num_tandem = len(runs)
    if not args.skip_hf:
        runs += [f"hf:{bs}:{dtype}" for dtype in args.hf_dtypes.split(",")
                 for bs in args.hf_batch_sizes.split(",")]
    common = ["--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len),
              "--output-len", str(args.output_len), "--dtype", args.dtype]
    if args.model:
        common += ["--model", args.model]
    results = []
    for run in runs:
        proc = subprocess.run([sys.executable, __file__, "--run", run, *common],
                              stdout=subprocess.PIPE, text=True, check=True)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
        print(f"  {results[-1]['name']} {results[-1]['dtype']}: {results[-1]['tok_per_s']:.1f} tok/s",
              file=sys.stderr)

    print(f"\n{args.num_prompts} prompts x {args.prompt_len} tokens -> {args.output_len} output tokens each")
    print(f"{'engine':<14} {'dtype':<10} {'seconds':>8} {'output tok/s':>13}")
    for r in results:
        print(f"{r['name']:<14} {r['dtype']:<10} {r['seconds']:>8.1f} {r['tok_per_s']:>13.1f}")
    for r in results[1:num_tandem]:
        print(f"\n{r['name']} / tandem: {r['tok_per_s'] / results[0]['tok_per_s']:.3f}x")
    if len(results) > num_tandem:
        best_hf = max(results[num_tandem:], key=lambda r: r["tok_per_s"])
        ratio = results[0]["tok_per_s"] / best_hf["tok_per_s"]
        print(f"\nTandem / best HF ({best_hf['name']}, {best_hf['dtype']}): {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
