"""What one frontend process costs per streamed token, against a stand-in backend.

    python bench/frontend_capacity.py [--tokenizer DIR] [--concurrency 32,256] [--max-tokens 64]
                                      [--tokens-per-run 16384] [--workloads all] [--json out.json]

It starts the stand-in backend (``tests/stand_in_backend.py``: the real gRPC
contract, no model, token IDs as fast as asked) and one real frontend process
(``tandem frontend``, i.e. ``frontend.entrypoints.cli``), then drives the
frontend with C concurrent clients (aiohttp), each sending its next request as
soon as its last one ended, for each workload and each C. Per run it reports:

- **frontend µs/token**: the frontend process's CPU time (utime + stime from
  ``/proc/<pid>/stat``, all its threads) over the run, per completion token;
- the stand-in's CPU per token (the other end of the same gRPC stream);
- tokens/s and requests/s (wall clock; on a small machine the client, the
  stand-in and the frontend share the cores);
- p50/p99 inter-token latency: the gaps between consecutive SSE events of
  one stream as the client receives them (streaming workloads only).

``--parts`` then splits a streamed token's CPU (``frontend_parts.measure_parts``): the app's own code through
ASGI on an in-process stand-in engine, and the gRPC client alone (on Generate, one message per
token, and on GenerateStream, one message per step of every request); the rest of the process's
figure is the HTTP server and the sockets. ``--frontend-arg`` passes a flag to the frontend.
``--stream-intervals 1,8`` runs everything once per value with the stand-in sending that many tokens
per response after a sequence's first, as the backend's ``--stream-interval`` does (column ``int``;
the inter-token latencies are then the gaps between events of several tokens).

Workloads: completions and chat, streamed and not, with and without logprobs
(one top alternative), each ``max_tokens`` long with ``ignore_eos``; and
``chat-short``: a one-token chat reply, not streamed, whose requests/s is the
per-request cost. The tokenizer defaults to the cached SmolLM2-135M-Instruct's
when present, else the tests' tiny BPE.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Workload:
    name: str
    chat: bool
    stream: bool
    logprobs: bool
    max_tokens: Optional[int] = None  # None: --max-tokens

    def body(self, model: str, max_tokens: int) -> dict:
        body: dict = {"model": model, "max_tokens": self.max_tokens or max_tokens, "ignore_eos": True,
                      "stream": self.stream}
        if self.chat:
            body["messages"] = [{"role": "user", "content": PROMPT}]
            if self.logprobs:
                body.update(logprobs=True, top_logprobs=1)
        else:
            body["prompt"] = PROMPT
            if self.logprobs:
                body["logprobs"] = 1
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # the exact token count, in the last chunk
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


WORKLOADS = {w.name: w for w in [
    Workload("completions-stream", chat=False, stream=True, logprobs=False),
    Workload("completions-stream-logprobs", chat=False, stream=True, logprobs=True),
    Workload("completions", chat=False, stream=False, logprobs=False),
    Workload("completions-logprobs", chat=False, stream=False, logprobs=True),
    Workload("chat-stream", chat=True, stream=True, logprobs=False),
    Workload("chat-stream-logprobs", chat=True, stream=True, logprobs=True),
    Workload("chat", chat=True, stream=False, logprobs=False),
    Workload("chat-logprobs", chat=True, stream=False, logprobs=True),
    Workload("chat-short", chat=True, stream=False, logprobs=False, max_tokens=1),
]}


@dataclass
class RunResult:
    workload: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    frontend_cpu_s: float
    stand_in_cpu_s: float
    frontend_sys_s: float = 0.0  # the kernel's share of frontend_cpu_s (stime: socket writes, epoll)
    itl_ms: list = field(default_factory=list, repr=False)
    balancer_cpu_s: Optional[float] = None  # a load balancer's, when the clients went through one

    def row(self) -> dict:
        itl = sorted(self.itl_ms)
        return {
            "workload": self.workload, "concurrency": self.concurrency, "requests": self.requests,
            "tokens": self.tokens, "wall_s": round(self.wall_s, 3),
            "frontend_us_per_token": round(1e6 * self.frontend_cpu_s / max(self.tokens, 1), 1),
            "frontend_us_per_request": round(1e6 * self.frontend_cpu_s / max(self.requests, 1), 1),
            "frontend_sys_us_per_token": round(1e6 * self.frontend_sys_s / max(self.tokens, 1), 1),
            "stand_in_us_per_token": round(1e6 * self.stand_in_cpu_s / max(self.tokens, 1), 1),
            "tokens_per_s": round(self.tokens / self.wall_s, 1),
            "requests_per_s": round(self.requests / self.wall_s, 1),
            "itl_p50_ms": round(_percentile(itl, 0.5), 3) if itl else None,
            "itl_p99_ms": round(_percentile(itl, 0.99), 3) if itl else None,
            **({} if self.balancer_cpu_s is None else
               {"balancer_us_per_token": round(1e6 * self.balancer_cpu_s / max(self.tokens, 1), 1)}),
        }


def _percentile(ordered: list, q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (every thread), from /proc/<pid>/stat."""
    return sum(cpu_split(pid))


def cpu_split_all(pids: list[int]) -> tuple[float, float]:
    """(utime, stime) summed over processes."""
    splits = [cpu_split(pid) for pid in pids]
    return sum(u for u, _ in splits), sum(s for _, s in splits)


def cpu_split(pid: int) -> tuple[float, float]:
    """(utime, stime) of a process (every thread) in seconds, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # the name may hold spaces: split after it
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS  # fields 14 and 15 of stat(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the processes ---------------------------------------------------------------------------


def start_stand_in(tokenizer_dir: str, step_ms: float = 0.0, timeout: float = 60.0,
                   generate_stream: bool = True, stream_interval: int = 1) -> tuple[subprocess.Popen, int]:
    """The stand-in backend in a process of its own; returns it and its gRPC port. Without
    ``generate_stream`` it refuses GenerateStream, so a frontend sends one Generate per request;
    ``stream_interval``: tokens per response after a sequence's first (the backend's flag)."""
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests" / "stand_in_backend.py"),
                             "--tokenizer", tokenizer_dir, "--step-ms", str(step_ms),
                             "--stream-interval", str(stream_interval),
                             *([] if generate_stream else ["--no-generate-stream"])],
                            stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()  # READY <port>, or "" if it died
    if not line.startswith("READY ") or time.monotonic() > deadline:
        proc.kill()
        raise RuntimeError(f"the stand-in backend did not start (said {line!r})")
    return proc, int(line.split()[1])


def start_frontend(backend_port: int, tokenizer_dir: str, extra_args: list[str] = (),
                   timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """``tandem frontend`` against the backend; returns it and its base URL once /health answers 200."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "frontend.entrypoints.cli", "frontend",
                             "--backend", f"127.0.0.1:{backend_port}", "--port", str(port),
                             "--tokenizer", tokenizer_dir, "--log-level", "warning", *extra_args], cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    return proc, wait_healthy(proc, url, timeout, "the frontend")


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, what: str, log: Optional[Path] = None) -> str:
    """``url`` once its /health answers 200; RuntimeError (``proc`` killed) if ``proc`` exits first,
    with the tail of ``log`` if given, or the timeout passes."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = f": {log.read_text()[-500:]}" if log is not None and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}{said}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} did not become healthy within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the load ----------------------------------------------------------------------------------


async def _one_request(session, url: str, body: dict, stream: bool, itl_ms: list) -> int:
    """Send one request; return its completion tokens (from usage). Raises on an HTTP error."""
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        if not stream:
            return (await response.json())["usage"]["completion_tokens"]
        tokens, last = None, None
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            if b'"usage":{' in line:  # the include_usage chunk: not a token
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                continue
            if line.startswith(b"data: [DONE]"):
                break
            if last is not None:
                itl_ms.append(1000 * (now - last))
            last = now
        if tokens is None:
            raise RuntimeError("the stream ended without its usage chunk")
        return tokens


async def drive(base_url: str, model: str, workload: Workload, concurrency: int, num_requests: int,
                max_tokens: int, frontend_pid, stand_in_pid: int, balancer_pids: list[int] = ()) -> RunResult:
    """``num_requests`` requests of ``workload`` from ``concurrency`` clients; the frontend's CPU over
    them (``frontend_pid``: one, or a list whose CPU is summed), and the balancer's if given."""
    frontend_pids = frontend_pid if isinstance(frontend_pid, list) else [frontend_pid]
    import aiohttp

    url = base_url + workload.path
    body = workload.body(model, max_tokens)
    itl_ms: list[float] = []
    tokens = 0
    next_index = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def client() -> None:
            nonlocal tokens, next_index
            while next_index < num_requests:
                next_index += 1
                got = await _one_request(session, url, body, workload.stream, itl_ms)
                tokens += got  # not `tokens += await ...`: that reads tokens before the await

        # Warm-up: a connection per client, and the frontend's first-request costs, outside the count.
        await asyncio.gather(*(_one_request(session, url, {**body, "max_tokens": 2}, workload.stream, [])
                               for _ in range(concurrency)))
        frontend_before, stand_in_before = cpu_split_all(frontend_pids), cpu_seconds(stand_in_pid)
        balancer_before = sum(cpu_split_all(list(balancer_pids)))
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        frontend_after = cpu_split_all(frontend_pids)
        stand_in_cpu = cpu_seconds(stand_in_pid) - stand_in_before
        balancer_cpu = sum(cpu_split_all(list(balancer_pids))) - balancer_before if balancer_pids else None
    frontend_cpu = sum(frontend_after) - sum(frontend_before)
    return RunResult(workload.name, concurrency, num_requests, tokens, wall, frontend_cpu, stand_in_cpu,
                     frontend_sys_s=frontend_after[1] - frontend_before[1], itl_ms=itl_ms,
                     balancer_cpu_s=balancer_cpu)


def requests_for(workload: Workload, concurrency: int, tokens_per_run: int, max_tokens: int) -> int:
    """Enough requests for about ``tokens_per_run`` tokens (short ones: a sixteenth as many), and
    at least one per client."""
    per_request = max(workload.max_tokens or max_tokens, 16)
    return max(concurrency, tokens_per_run // per_request)


def tiny_tokenizer(directory: Path) -> str:
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from conftest import build_tokenizer

    build_tokenizer(directory)
    return str(directory)


def run_bench(tokenizer_dir: str, workloads: list[Workload], concurrencies: list[int], max_tokens: int,
              tokens_per_run: int, frontend_args: list[str] = (), step_ms: float = 0.0,
              report=print, rpc: str = "GenerateStream", stream_interval: int = 1) -> list[dict]:
    """Start the stand-in and a frontend, run every (workload, concurrency), stop both; the rows.
    ``rpc``: what the frontend streams with (``Generate``: the stand-in refuses GenerateStream);
    ``stream_interval``: the stand-in's tokens per response after a sequence's first."""
    stand_in, backend_port = start_stand_in(tokenizer_dir, step_ms, generate_stream=rpc == "GenerateStream",
                                            stream_interval=stream_interval)
    frontend = None
    rows = []
    try:
        frontend, url = start_frontend(backend_port, tokenizer_dir, list(frontend_args))
        for workload in workloads:
            for concurrency in concurrencies:
                num_requests = requests_for(workload, concurrency, tokens_per_run, max_tokens)
                result = asyncio.run(drive(url, "stand-in", workload, concurrency, num_requests, max_tokens,
                                           frontend.pid, stand_in.pid))
                rows.append({"rpc": rpc, "stream_interval": stream_interval, **result.row()})
                report(format_row(rows[-1]))
    finally:
        if frontend is not None:
            stop(frontend)
        stop(stand_in)
    return rows


HEADER = (f"{'rpc':<15} {'int':>3} {'workload':<28} {'C':>4} {'reqs':>5} {'tokens':>7} {'fe µs/tok':>9} {'(sys)':>6} {'fe µs/req':>9} "
          f"{'si µs/tok':>9} {'tok/s':>8} {'req/s':>7} {'itl p50':>8} {'itl p99':>8}")


def format_row(row: dict) -> str:
    def ms(value):
        return f"{value:8.2f}" if value is not None else f"{'-':>8}"

    return (f"{row['rpc']:<15} {row.get('stream_interval', 1):>3} {row['workload']:<28} {row['concurrency']:>4} {row['requests']:>5} {row['tokens']:>7} "
            f"{row['frontend_us_per_token']:>9.1f} {row['frontend_sys_us_per_token']:>6.1f} "
            f"{row['frontend_us_per_request']:>9.0f} "
            f"{row['stand_in_us_per_token']:>9.1f} {row['tokens_per_s']:>8.0f} {row['requests_per_s']:>7.1f} "
            f"{ms(row['itl_p50_ms'])} {ms(row['itl_p99_ms'])}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=None,
                        help=f"tokenizer directory (default: {DEFAULT_TOKENIZER} if present, else the tests' tiny BPE)")
    parser.add_argument("--concurrency", default="32,256", help="concurrent clients, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (ignore_eos)")
    parser.add_argument("--tokens-per-run", type=int, default=8192,
                        help="about this many tokens per (workload, concurrency); at least a request per client")
    parser.add_argument("--workloads", default="all", help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--step-ms", type=float, default=0.0, help="the stand-in's pause between steps")
    parser.add_argument("--rpcs", default="GenerateStream",
                        help="comma-separated: GenerateStream (one message per step of every request) and/or "
                             "Generate (the stand-in refuses GenerateStream: one message per token per request)")
    parser.add_argument("--stream-intervals", default="1",
                        help="comma-separated: the stand-in's tokens per response after a sequence's first, as "
                             "the backend's --stream-interval (each value a run of its own)")
    parser.add_argument("--parts", action="store_true",
                        help="also measure the parts alone, in this process: the app through ASGI on an in-process "
                             "stand-in engine, and the gRPC client reading the stand-in's streams")
    parser.add_argument("--json", default=None, help="write the rows and the conditions here")
    parser.add_argument("--frontend-arg", action="append", default=[], help="an extra flag for the frontend")
    args = parser.parse_args(argv)
    workloads = list(WORKLOADS.values()) if args.workloads == "all" else [WORKLOADS[n] for n in args.workloads.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = args.tokenizer
        if tokenizer_dir is None:
            tokenizer_dir = str(DEFAULT_TOKENIZER) if DEFAULT_TOKENIZER.is_dir() else tiny_tokenizer(Path(scratch))
        print(f"tokenizer {tokenizer_dir}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
        print(HEADER)
        rows = []
        for rpc in args.rpcs.split(","):
            if rpc not in ("GenerateStream", "Generate"):
                parser.error(f"--rpcs: {rpc!r} is neither GenerateStream nor Generate")
            for interval in (int(i) for i in args.stream_intervals.split(",")):
                rows += run_bench(tokenizer_dir, workloads, concurrencies, args.max_tokens, args.tokens_per_run,
                                  args.frontend_arg, args.step_ms, rpc=rpc, stream_interval=interval)
        parts = []
        if args.parts:
            from frontend_parts import measure_parts


            print(f"{'part':<24} {'workload':<28} {'C':>4} {'µs/tok':>8}")
            parts = measure_parts(tokenizer_dir, workloads, concurrencies, args.max_tokens, args.tokens_per_run)
    if args.json:
        conditions = {"tokenizer": tokenizer_dir, "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
                      "max_tokens": args.max_tokens, "step_ms": args.step_ms}
        Path(args.json).write_text(json.dumps({"conditions": conditions, "rows": rows, "parts": parts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
