"""How long a big prompt's tokenization stalls the frontend's event loop: inline, on a worker
thread (what ``frontend.serving.prompts`` does), or in a worker process.

    python bench/tokenize_off_loop.py [TOKENIZER_DIR] [--chars 800000]

A ticker coroutine sleeps 1 ms at a time on the event loop while one prompt is tokenized; the
table gives the wall time and the ticker's longest and 99th-percentile gap (how late a small
request would be served meanwhile). Without a directory it builds the tests' tiny BPE tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from frontend.tokenizer import encode_prompt, load_tokenizer  # noqa: E402

_worker_tokenizer = None


def _load_in_worker(path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(path)


def _encode_in_worker(text: str) -> list[int]:
    return encode_prompt(_worker_tokenizer, text)


async def measure(run) -> tuple[float, float, float]:
    """(seconds, longest gap ms, p99 gap ms) of awaiting ``run()`` beside a 1 ms ticker."""
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    await run()
    seconds = time.perf_counter() - start
    done = True
    await ticker
    gaps.sort()
    return seconds, gaps[-1] * 1e3, gaps[int(len(gaps) * 0.99)] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer", nargs="?", default=None)
    parser.add_argument("--chars", type=int, default=800_000)
    args = parser.parse_args()
    path = args.tokenizer
    if path is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import build_tokenizer

        path = tempfile.mkdtemp()
        build_tokenizer(Path(path))
    tokenizer = load_tokenizer(path)
    text = ("The capital of France is Paris. " * (args.chars // 32 + 1))[:args.chars]
    threads = ThreadPoolExecutor(1)
    processes = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_load_in_worker,
                                    initargs=(path,))
    processes.submit(_encode_in_worker, "warm up").result()

    async def run_all() -> None:
        loop = asyncio.get_running_loop()

        async def inline() -> None:
            encode_prompt(tokenizer, text)

        async def thread() -> None:
            await loop.run_in_executor(threads, encode_prompt, tokenizer, text)

        async def process() -> None:
            await loop.run_in_executor(processes, _encode_in_worker, text)

        print(f"{args.chars} characters; event-loop gaps while tokenizing")
        print(f"{'where':<16} {'seconds':>8} {'max gap ms':>11} {'p99 gap ms':>11}")
        for name, run in (("inline", inline), ("worker thread", thread), ("worker process", process)):
            seconds, longest, p99 = await measure(run)
            print(f"{name:<16} {seconds:>8.2f} {longest:>11.0f} {p99:>11.1f}")

    asyncio.run(run_all())
    processes.shutdown()


if __name__ == "__main__":
    main()
