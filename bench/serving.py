"""Load generator for any OpenAI-compatible server: streaming /v1/completions at fixed concurrency.

Each request gets a distinct prompt of ``--prompt-len`` tokens (distinct from its first token, so
no server can answer from a prefix cache) and must produce exactly ``--output-len`` tokens
(``ignore_eos``, greedy). All ``--num-prompts`` requests of a level are offered with at most
``concurrency`` in flight. Metrics follow vLLM's benchmark definitions:

    TTFT  time from sending a request to its first streamed token
    TPOT  per request, (latency - TTFT) / (output tokens - 1)
    ITL   every gap between consecutive streamed chunks of a request
    throughput  output tokens (or requests) completed / wall time of the level

    python bench/serving.py --url http://127.0.0.1:8000 --concurrency 1,8,32
    python bench/serving.py --url http://127.0.0.1:8080 --model x --json llama.json

Every level is bounded: ``--timeout`` seconds per request, and the level's requests are counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
import time
from dataclasses import dataclass, field

import httpx

# Run as a script, bench/ is sys.path[0]: the repository's root goes there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.prompts import document  # noqa: E402


def make_prompts(num: int, prompt_len: int, tokenizer=None, start: int = 0) -> list[str]:
    """num distinct prompts of about prompt_len tokens (exactly, when a tokenizer is given):
    documents start .. start + num - 1."""
    prompts = []
    for i in range(start, start + num):
        text = document(i, 3 * prompt_len // 20 + 4)
        if tokenizer is not None:
            text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:prompt_len])
        else:
            text = " ".join(text.split()[: max(1, int(prompt_len * 0.75))])
        prompts.append(text)
    return prompts


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, output_len: int,
                      timeout: float) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                usage = event.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                choices = event.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = last is not None
    return result


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": q[49], "p90": q[89], "p99": q[98], "mean": statistics.fmean(values)}


async def run_level(url: str, model: str, prompts: list[str], output_len: int, concurrency: int,
                    timeout: float) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        async def bounded(prompt):
            async with semaphore:
                return await one_request(client, url, model, prompt, output_len, timeout)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "concurrency": concurrency, "requests": len(results), "completed": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration, "output_tokens": tokens,
        "prompt_tokens_mean": statistics.fmean([r.prompt_tokens for r in ok]) if ok else 0,
        "request_throughput": len(ok) / duration, "output_throughput": tokens / duration,
        "ttft_s": percentiles([r.ttft for r in ok]), "tpot_s": percentiles(tpot),
        "itl_s": percentiles([gap for r in ok for gap in r.itl]),
    }


def print_table(name: str, levels: list[dict], file=sys.stdout) -> None:
    print(f"\n{name}", file=file)
    print(f"{'conc':>5} {'done':>6} {'req/s':>7} {'out tok/s':>10} {'TTFT p50/p90/p99 (ms)':>24} "
          f"{'TPOT p50 (ms)':>14} {'ITL p50/p99 (ms)':>18}", file=file)
    for r in levels:
        t, tp, itl = r["ttft_s"], r["tpot_s"], r["itl_s"]
        print(f"{r['concurrency']:>5} {r['completed']:>3}/{r['requests']:<2} {r['request_throughput']:>7.2f} "
              f"{r['output_throughput']:>10.1f} {t['p50'] * 1e3:>8.0f}/{t['p90'] * 1e3:.0f}/{t['p99'] * 1e3:.0f} "
              f"{tp['p50'] * 1e3:>14.1f} {itl['p50'] * 1e3:>9.1f}/{itl['p99'] * 1e3:.1f}", file=file)
        for error in r["errors"]:
            print(f"      error: {error}", file=file)


def load_tokenizer(path: str | None):
    if path is None:
        return None
    from frontend.tokenizer import load_tokenizer as load

    return load(path)


async def run_levels(url: str, model: str, levels: list[int], num_prompts: int | None, prompt_len: int,
                     output_len: int, timeout: float, tokenizer=None, warmup: bool = True,
                     waves: int = 2) -> list[dict]:
    """One result per concurrency level (num_prompts None: waves x concurrency)."""
    if warmup:
        await run_level(url, model, make_prompts(1, 16, tokenizer), 4, 1, timeout)
    out = []
    for offset, concurrency in enumerate(levels):
        n = num_prompts or waves * concurrency
        # A fresh prompt set per level (offset), so no level hits an earlier level's prefix cache.
        prompts = make_prompts(n * (offset + 1), prompt_len, tokenizer)[n * offset:]
        out.append(await run_level(url, model, prompts, output_len, concurrency, timeout))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--num-prompts", type=int, default=None, help="per level (default: waves x concurrency)")
    parser.add_argument("--waves", type=int, default=2, help="without --num-prompts: requests per level = waves x concurrency")
    parser.add_argument("--prompt-len", type=int, default=120)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer dir for exact prompt lengths")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    model = args.model
    if model is None:
        model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    levels = asyncio.run(run_levels(args.url, model, [int(c) for c in args.concurrency.split(",")],
                                    args.num_prompts, args.prompt_len, args.output_len, args.timeout,
                                    load_tokenizer(args.tokenizer), waves=args.waves))
    print_table(f"{args.url} ({model}): {args.prompt_len}-token prompts -> {args.output_len} tokens", levels)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(levels, f, indent=2)


if __name__ == "__main__":
    main()
