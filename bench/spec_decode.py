"""Speculative decoding (n-gram prompt lookup) against plain decoding, batch 1, one run.

The workload repeats its input, as edits and summaries do: the chat model is asked to copy a
paragraph with small changes. Each configuration runs in its own process, greedy, the same
prompts; prints decode tok/s, the draft acceptance rate and the speed-up, and checks that both
produced the same tokens.

    python bench/spec_decode.py
    python bench/spec_decode.py --num-speculative-tokens 6 --max-tokens 200
    python bench/spec_decode.py --quantization int8      # both runs on int8 weights
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
import time

# Run as a script, bench/ is sys.path[0]: the repository's root goes there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

PARAGRAPHS = [
    "The printing press was invented in the fifteenth century. It allowed books to be made quickly "
    "and cheaply, and ideas spread across Europe faster than ever before. Within fifty years, "
    "millions of books had been printed in hundreds of cities.",
    "Photosynthesis is the process by which plants turn light, water and carbon dioxide into sugar "
    "and oxygen. It takes place in the chloroplasts of leaf cells, and it is the source of almost "
    "all the oxygen in the air we breathe.",
    "A distributed system is a group of computers that work together and appear to their users as "
    "a single computer. The machines share state, tolerate the failure of some of their members, "
    "and keep working while parts of the network are down.",
]


def conversations() -> list[list[dict]]:
    return [[{"role": "user", "content": "Copy the following text exactly, but replace every "
              f"'and' with '&':\n\n{text}"}] for text in PARAGRAPHS]


def run_one(args) -> dict:
    from frontend import LLM, SamplingParams

    spec = None
    if args.run == "spec":
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": 1}
    llm = LLM(model=args.model, speculative_config=spec, dtype=args.dtype, quantization=args.quantization)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    tokens, elapsed = [], 0.0
    for messages in conversations():  # batch 1: one request at a time
        start = time.perf_counter()
        out = llm.chat(messages, params, use_tqdm=False)[0]
        elapsed += time.perf_counter() - start
        tokens.append(out.outputs[0].token_ids)
    engine = llm.engine.engine
    result = {"run": args.run, "seconds": elapsed, "tokens": sum(map(len, tokens)), "token_ids": tokens,
              "drafts": engine.num_draft_tokens_total, "accepted": engine.num_accepted_tokens_total}
    llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--prompt-lookup-max", type=int, default=3)
    parser.add_argument("--quantization", default=None, help="e.g. int8 (both runs)")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    results = {}
    for run in ("plain", "spec"):
        argv = [sys.executable, __file__, "--run", run, "--max-tokens", str(args.max_tokens), "--dtype",
                args.dtype, "--num-speculative-tokens", str(args.num_speculative_tokens),
                "--prompt-lookup-max", str(args.prompt_lookup_max)] + (["--model", args.model] if args.model else []) \
            + (["--quantization", args.quantization] if args.quantization else [])
        proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
        results[run] = json.loads(line[len("RESULT "):])
    plain, spec = results["plain"], results["spec"]
    print(f"{len(PARAGRAPHS)} copy-with-edits prompts, batch 1, greedy, up to {args.max_tokens} tokens each"
          + (f", {args.quantization} weights" if args.quantization else ""))
    print(f"{'':<8} {'tok/s':>8} {'drafts':>8} {'accepted':>9}")
    for r in (plain, spec):
        print(f"{r['run']:<8} {r['tokens'] / r['seconds']:>8.1f} {r['drafts']:>8} {r['accepted']:>9}")
    rate = spec["accepted"] / max(spec["drafts"], 1)
    speedup = (spec["tokens"] / spec["seconds"]) / (plain["tokens"] / plain["seconds"])
    print(f"\nacceptance {rate:.0%}; speed-up {speedup:.2f}x; "
          f"outputs identical: {spec['token_ids'] == plain['token_ids']}")


if __name__ == "__main__":
    main()
