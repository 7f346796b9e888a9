"""Prefix-cache hit rate by routing policy: prefix affinity vs round-robin vs least-loaded.

    python bench/routing.py [--backends 2] [--prefixes 16] [--repeats 6] [--prefix-tokens 160]
                            [--num-kv-blocks 128] [--concurrency 4] [--model DIR]

The same workload for every policy: ``prefixes`` shared prompt prefixes (a system prompt, a
document), each sent ``repeats`` times with a distinct suffix, in one shuffled order, at most
``concurrency`` in flight. Each policy gets freshly started backends (cold caches) of
``num_kv_blocks`` blocks each, so a policy that scatters a prefix over every backend also makes
each backend hold more prefixes than fit. The hit rate is the backends' own
``tandem:prefix_cache_hits`` / ``tandem:prefix_cache_queries`` (prompt tokens). The model is a
tiny random Llama by default (hit rates do not depend on the weights). Bounded: a fixed request
count, each request with a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

from helpers import free_port  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from backend.types.sampling_params import SamplingParams  # noqa: E402
from frontend.router import POLICIES, Router, parse_targets  # noqa: E402

REQUEST_TIMEOUT_S = 120
STARTUP_TIMEOUT_S = 120


def start_backends(model: str, count: int, num_kv_blocks: int, work: Path) -> list[tuple]:
    backends = []
    for i in range(count):
        port, metrics_port = free_port(), free_port()
        log = work / f"backend-{port}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "backend.server", model, "--host", "127.0.0.1", "--port", str(port),
                 "--metrics-port", str(metrics_port), "--dtype", "float32", "--num-kv-blocks", str(num_kv_blocks),
                 "--max-model-len", "512"], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        backends.append((process, port, metrics_port, log))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for process, port, _, log in backends:
        while f"on 127.0.0.1:{port}" not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"a backend did not start:\n{log.read_text()}")
            time.sleep(0.1)
    return backends


def scrape(metrics_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def run_workload(router: Router, prompts: list[list[int]], concurrency: int) -> float:
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: list[int]) -> None:
        async with limit:
            async def consume() -> None:
                async for _ in router.generate(f"req-{i}", prompt, SamplingParams(max_tokens=4, ignore_eos=True)):
                    pass

            await asyncio.wait_for(consume(), REQUEST_TIMEOUT_S)

    start = time.monotonic()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.monotonic() - start


def measure(policy: str, args, prompts: list[list[int]], work: Path) -> dict:
    backends = start_backends(args.model, args.backends, args.num_kv_blocks, work)
    try:
        async def go() -> float:
            router = Router(parse_targets(",".join(f"127.0.0.1:{port}" for _, port, _, _ in backends)), policy)
            await router.start()
            try:
                return await run_workload(router, prompts, args.concurrency)
            finally:
                await router.close()

        seconds = asyncio.run(go())
        totals = [scrape(metrics_port) for _, _, metrics_port, _ in backends]
    finally:
        for process, *_ in backends:
            process.send_signal(signal.SIGTERM)
        for process, *_ in backends:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    hits = sum(t.get("tandem:prefix_cache_hits_total", 0) for t in totals)
    queries = sum(t.get("tandem:prefix_cache_queries_total", 0) for t in totals)
    computed = sum(t.get("tandem:prompt_tokens_computed_total", 0) for t in totals)
    per_backend = [int(t.get("tandem:request_success_total", 0)) for t in totals]
    return {"policy": policy, "hit_rate": hits / queries, "computed": computed, "seconds": seconds,
            "per_backend": per_backend}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", type=int, default=2)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=160)
    parser.add_argument("--num-kv-blocks", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--model", default=None, help="a model directory (default: a tiny random Llama)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tandem-routing-"))
    if args.model is None:
        from conftest import TINY_VOCAB, make_tiny_checkpoint

        args.model = str(make_tiny_checkpoint(work / "model", "llama"))
        vocab = TINY_VOCAB
    else:
        import json

        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(8)] for prefix in prefixes for _ in range(args.repeats)]
    rng.shuffle(prompts)

    print(f"{args.backends} backends x {args.num_kv_blocks} KV blocks; {args.prefixes} prefixes of "
          f"{args.prefix_tokens} tokens, each sent {args.repeats} times (+8 distinct tokens), "
          f"{len(prompts)} requests, {args.concurrency} in flight\n")
    print(f"| policy | prefix-cache hit rate | prompt tokens computed | requests per backend | seconds |")
    print(f"|---|---|---|---|---|")
    for policy in POLICIES:
        row = measure(policy, args, prompts, work)
        print(f"| {row['policy']} | {row['hit_rate']:.1%} | {row['computed']:.0f} | "
              f"{' / '.join(map(str, row['per_backend']))} | {row['seconds']:.1f} |", flush=True)
    block = 16  # the backends' default block_size: only full blocks are cached
    ideal = (1 - 1 / args.repeats) * (args.prefix_tokens // block * block) / (args.prefix_tokens + 8)
    print(f"\n(the best any policy can do here: {ideal:.1%}, each prefix's full blocks computed once)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
