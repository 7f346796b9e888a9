"""llama.cpp's HTTP server for the benchmarks: its two builds, its throughput settings, what it ran.

Two builds can serve: the ``xllamacpp`` wheel (prebuilt, run in a Python process) and a native
``llama-server`` binary (``bench/build_llamacpp.sh``). Both get the same settings, chosen as
llama.cpp's server documentation advises for throughput on a CPU:

- threads (generation and batch) = the machine's physical cores (not its hardware threads);
- flash attention on;
- ``n_parallel`` = the concurrency of the level, continuous batching on, and a context of
  ``n_parallel`` x (prompt + output + margin) tokens, so every slot holds a whole request;
- ``n_batch`` 2048 and ``n_ubatch`` 512 (llama.cpp's defaults, the sizes its docs suggest for
  prompt throughput on a CPU), overridable.

``settings_record`` is what the server really ran with: for the wheel every scalar field of its
``CommonParams`` (written by the server process), for a binary its command line; plus the build's
version, and the lines of its log that name its build, threads and slots.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

XLLAMACPP = "xllamacpp"

# Run by the wheel's server process: argv = gguf, port, settings JSON, where to write its params.
_WHEEL_SERVER = """
import json, sys, time, xllamacpp
gguf, port, settings, record = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
p = xllamacpp.CommonParams()
p.model.path, p.port, p.hostnames = gguf, port, ["127.0.0.1"]
p.n_parallel, p.n_ctx, p.cont_batching = settings["n_parallel"], settings["n_ctx"], True
p.n_batch, p.n_ubatch = settings["n_batch"], settings["n_ubatch"]
p.cpuparams.n_threads = settings["n_threads"]
p.cpuparams_batch.n_threads = settings["n_threads_batch"]
fa = xllamacpp.llama_flash_attn_type
p.flash_attn_type = fa.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings["flash_attn"] else fa.LLAMA_FLASH_ATTN_TYPE_DISABLED

def scalars(obj):
    out = {}
    for name in dir(obj):
        if name.startswith("_"):
            continue
        try:
            value = getattr(obj, name)
        except Exception:
            continue
        if isinstance(value, (bool, int, float, str)) or (hasattr(value, "name") and hasattr(value, "value")):
            out[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out

with open(record, "w") as f:
    json.dump({"params": scalars(p), "cpuparams": scalars(p.cpuparams),
               "cpuparams_batch": scalars(p.cpuparams_batch), "model": scalars(p.model)}, f, indent=1)
server = xllamacpp.Server(p)
print("READY", flush=True)
while True:
    time.sleep(3600)
"""


@dataclass
class LlamaSettings:
    n_parallel: int
    n_ctx: int
    n_threads: int
    n_threads_batch: int
    flash_attn: bool
    n_batch: int
    n_ubatch: int


def physical_cores() -> int:
    """Distinct (package, core) pairs in /proc/cpuinfo; the CPU count where it lists none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.cpu_count() or 1
    cores, package = set(), "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "physical id":
            package = value
        elif key == "core id":
            cores.add((package, value))
    return len(cores) or os.cpu_count() or 1


def tuned_settings(concurrency: int, tokens_per_request: int, threads: int | None = None,
                   n_batch: int = 2048, n_ubatch: int = 512, flash_attn: bool = True) -> LlamaSettings:
    """The throughput settings for one concurrency level (see the module's docstring)."""
    threads = threads or physical_cores()
    return LlamaSettings(n_parallel=concurrency, n_ctx=concurrency * (tokens_per_request + 64),
                         n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn,
                         n_batch=n_batch, n_ubatch=min(n_ubatch, n_batch))


def server_argv(build: str, gguf: Path, port: int, settings: LlamaSettings, record: Path) -> list[str]:
    """The command that serves ``gguf`` on 127.0.0.1:``port``; ``build`` is ``XLLAMACPP`` or the
    path of a ``llama-server`` binary. The wheel writes its parameters to ``record``."""
    if build == XLLAMACPP:
        return [sys.executable, "-c", _WHEEL_SERVER, str(gguf), str(port), json.dumps(asdict(settings)),
                str(record)]
    s = settings
    return [build, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(s.n_parallel), "--ctx-size", str(s.n_ctx), "--cont-batching",
            "--threads", str(s.n_threads), "--threads-batch", str(s.n_threads_batch),
            "--flash-attn", "on" if s.flash_attn else "off",
            "--batch-size", str(s.n_batch), "--ubatch-size", str(s.n_ubatch)]


def build_info(build: str) -> dict:
    """The build's name, version and compile-time CPU features, as it reports them."""
    if build == XLLAMACPP:
        import xllamacpp

        return {"build": f"xllamacpp {getattr(xllamacpp, '__version__', '?')} (PyPI wheel)",
                "version": str(xllamacpp.BUILD_INFO), "system_info": xllamacpp.get_system_info().strip()}
    info = {"build": f"native llama-server {build}"}
    try:
        done = subprocess.run([build, "--version"], capture_output=True, text=True, timeout=60)
        info["version"] = " ".join((done.stdout + done.stderr).split())[-300:]
    except (OSError, subprocess.TimeoutExpired) as error:
        info["version"] = f"unknown ({error})"
    notes = Path(build).with_name("BUILD_INFO")
    if notes.exists():
        info["build_info"] = notes.read_text().strip()
    return info


LOG_FACTS = re.compile(r"system_info|build_info|n_threads =|n_ctx_slot|flash_attn|n_batch|n_ubatch|CPU :")


def log_facts(log: Path, pattern: re.Pattern = LOG_FACTS) -> list[str]:
    """The lines of a server's log that say what it runs with (build, threads, slots, CPU features)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line.strip() for line in lines if pattern.search(line)][:20]


def settings_record(build: str, settings: LlamaSettings, argv: list[str], record: Path, log: Path) -> dict:
    """Everything that describes one llama.cpp server run, for the results file."""
    out = {"tuned": asdict(settings), "log": log_facts(log)}
    if build == XLLAMACPP and record.exists():
        out["wheel_params"] = json.loads(record.read_text())
    else:
        out["argv"] = argv
    return out


def build_label(build: str) -> str:
    return "xllamacpp wheel" if build == XLLAMACPP else "native build"
