"""Building the fused CPU kernels (``csrc/``) for one ISA level (``tandem_kernels.isa``), and the
names the libraries go by; ``tandem_kernels.cpu`` finds or builds and loads them.

Each source compiles on its own (side by side, as many as this process may use cores) with the
level's explicit target flags and ``-mtune=generic``, never ``-march=native``, so the library
runs on every CPU of its level, whichever machine built it. The objects link into one library.
The exception is ``isa.NATIVE``, for CPUs that are not x86-64: built with the compiler's own
``-mcpu=native`` or ``-march=native`` (``native_flags``) into the cache only, never prebuilt.

Two places hold libraries, under names that change with any file in ``csrc/`` (edited, added,
removed or renamed), torch's version and the level:

    prebuilt  ``$TANDEM_PREBUILT_KERNELS`` (default /opt/tandem/kernels), read-only, searched
              first: ``tandem_cpu_ops-<level>-<key>.so``, no compiler needed to find it (images)
    cache     ``$TANDEM_KERNEL_CACHE`` (default ~/.cache/tandem/kernels), per user: the same key
              and the compiler's version (for ``native``, also the machine and its CPU's flags,
              since that build runs only where it was made), built on first use

A build holds ``build_lock(output)`` (an flock on ``<output>.lock``), so two processes, or two
threads of one, never compile the same library at once: whoever waited finds it built. It works in
a scratch folder beside the library (``<output>.build-*``), removed however the build ends: on a
failure its other compilers are stopped at once; when the process exits mid-build (a background
build abandoned) an exit hook stops them and removes the folder; the folder of a process killed
outright is removed by the next build of that library.

Prebuild for images (a level this machine cannot run still compiles; it is not run here):

    python -m tandem_kernels.build --levels all --out /opt/tandem/kernels
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

from tandem_kernels.isa import (LEVELS, NATIVE, IsaLevel, host_cpu_flags, host_is_x86_64, level_named,
                                missing_flags)

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # every .cpp and .h here is part of the build and its key
DEFAULT_PREBUILT_DIR = "/opt/tandem/kernels"
_COMPILE_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-ffp-contract=off", "-w"]
_LINK_FLAGS = ["-shared", "-fopenmp"]


def compiler() -> Optional[str]:
    """$CXX as given (even where it does not exist: the build then says so), else c++ or g++."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def sources() -> list[Path]:
    """The translation units: each compiled on its own, all linked into one library."""
    return sorted(CSRC.glob("*.cpp"))


def build_files() -> list[Path]:
    """What the build reads from csrc/: the sources and the headers they include."""
    return sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])


@functools.lru_cache(maxsize=None)
def native_flags(cxx: str) -> tuple[str, ...]:
    """The flag that makes ``cxx`` target this very CPU: the first it accepts (without a warning)
    of -mcpu=native and -march=native (Arm's compilers prefer -mcpu, which also tunes; elsewhere
    -march first); none where it takes neither (the compiler's default target, still correct)."""
    arm = platform.machine().lower().startswith(("aarch64", "arm"))
    candidates = ("-mcpu=native", "-march=native") if arm else ("-march=native", "-mcpu=native")
    for flag in candidates:  # -fsyntax-only: the flag is checked, nothing is written anywhere
        try:
            probe = [cxx, flag, "-Werror", "-x", "c++", "-fsyntax-only", "-"]
            proc = subprocess.run(probe, input="int probe() { return 0; }\n", capture_output=True,
                                  text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return ()
        if proc.returncode == 0:
            return (flag,)
    return ()


def target_flags(cxx: str, level: IsaLevel) -> tuple[str, ...]:
    """What the compiler is told of the target: the level's own flags, or for ``native`` what
    ``native_flags`` finds."""
    return native_flags(cxx) if level is NATIVE else level.compile_flags


def compile_command(cxx: str, level: IsaLevel, source: Path, obj: Path) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [cxx, *_COMPILE_FLAGS, *target_flags(cxx, level), abi, *includes,
            f"-I{sysconfig.get_paths()['include']}", "-c", str(source), "-o", str(obj)]


def link_command(cxx: str, objs: list[Path], output: Path) -> list[str]:
    from torch.utils import cpp_extension

    lib_dir = cpp_extension.library_paths()[0]
    return [cxx, *_LINK_FLAGS, *map(str, objs), "-o", str(output), f"-L{lib_dir}", "-lc10",
            "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build_key(level: IsaLevel) -> str:
    """Of every file in csrc/ (names and contents), torch's version, the level and the flags:
    nothing of the machine, so a build made elsewhere for this level is found here."""
    files = [f"{path.name}\0{path.read_text()}" for path in build_files()]
    return _digest(*files, torch.__version__, level.name, " ".join(
        [*_COMPILE_FLAGS, *level.compile_flags, *_LINK_FLAGS]))


def library_name(level: IsaLevel) -> str:
    """The prebuilt library's file name (in ``prebuilt_dir()`` or a build's --out); ``native`` has
    none (ValueError): it is never prebuilt."""
    if level is NATIVE:
        raise ValueError("the native build is made by each machine for itself: it is never prebuilt")
    return f"tandem_cpu_ops-{level.name}-{build_key(level)}.so"


def prebuilt_dir() -> Path:
    return Path(os.environ.get("TANDEM_PREBUILT_KERNELS") or DEFAULT_PREBUILT_DIR).expanduser()


def cached_library(level: IsaLevel, cxx: str) -> Path:
    """Where this machine's own build for the level lives: the prebuilt key plus the compiler's
    version; for ``native`` also the machine, its CPU's flags and the flags the compiler took, since
    a cache may be shared by hosts (a network home) and that build runs only where it was made.
    Raises OSError where the compiler cannot be run."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    host = ()
    if level is NATIVE:
        host = (platform.machine(), " ".join(sorted(host_cpu_flags())), " ".join(native_flags(cxx)))
    base = Path(os.environ.get("TANDEM_KERNEL_CACHE") or "~/.cache/tandem/kernels").expanduser()
    return base / f"tandem_cpu_ops-{level.name}-{_digest(build_key(level), version, *host)}.so"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


_builds_lock = threading.Lock()
_builds: dict[Path, list[subprocess.Popen]] = {}  # each build's scratch folder -> the compilers it started
_exiting = False  # set by the exit hook: no compiler starts after it


def _start(command: list[str], folder: Path, log: Path) -> subprocess.Popen:
    """``command`` in its own session and process group (stopping the group stops the compiler's children),
    its messages into ``log``; RuntimeError where the build was discarded (the process exiting)."""
    with _builds_lock:
        if _exiting or folder not in _builds:
            raise RuntimeError("the build was abandoned: the process is exiting")
        with open(log, "wb") as messages:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=messages, stderr=messages,
                                    start_new_session=True)
        _builds[folder].append(proc)
    return proc


def _run_all(commands: list[list[str]], folder: Path, jobs: int) -> None:
    """Runs ``commands``, ``jobs`` at a time; raises RuntimeError with the compiler's message as soon
    as one fails (the others left running for ``_discard`` to stop)."""
    waiting, running = list(enumerate(commands)), []
    while waiting or running:
        while waiting and len(running) < jobs:
            i, command = waiting.pop(0)
            running.append((i, _start(command, folder, folder / f"{i}.log")))
        for entry in list(running):
            i, proc = entry
            if proc.poll() is None:
                continue
            running.remove(entry)
            if proc.returncode != 0:
                message = (folder / f"{i}.log").read_text(errors="replace")
                raise RuntimeError(f"the compiler failed:\n{message[-2000:]}")
        if running:
            time.sleep(0.02)


def _discard(folder: Path) -> None:
    """Stops the build's compilers still running (each whole process group) and removes its folder."""
    with _builds_lock:
        procs = _builds.pop(folder, [])
    for proc in procs:
        if proc.poll() is None:  # not yet reaped, so its group id is still its own
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


@atexit.register
def _discard_all() -> None:
    """At exit, the builds a daemon thread still runs (their thread stops without cleaning up)."""
    global _exiting
    with _builds_lock:
        _exiting = True
        folders = list(_builds)
    for folder in folders:
        _discard(folder)


@contextlib.contextmanager
def build_lock(output: Path) -> Iterator[None]:
    """Held by whoever builds ``output``: an exclusive flock on ``<output>.lock`` (each holder opens
    the file itself, so threads of one process exclude each other as processes do). Logs a line
    when it has to wait. Where there is no flock (not POSIX), nothing is locked; the rename in
    ``build`` still keeps a library whole."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output.parent / f"{output.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another build of %s to finish ...", output.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(level: IsaLevel, cxx: str, output: Path) -> None:
    """Compiles and links the library for ``level`` into ``output``, in a scratch folder removed
    however it ends, then renames it into place. Called under ``build_lock(output)``: scratch
    folders an earlier build of ``output`` left (its process killed) are removed first. Raises
    RuntimeError or OSError."""
    output.parent.mkdir(parents=True, exist_ok=True)
    for stale in output.parent.glob(f"{output.name}.build-*"):
        shutil.rmtree(stale, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{output.name}.build-", dir=output.parent))
    with _builds_lock:
        _builds[folder] = []
    try:
        units = sources()
        objs = [folder / f"{source.stem}.o" for source in units]
        # Each translation unit parses torch's headers (~7 s) on its own, so they compile side by side.
        _run_all([compile_command(cxx, level, s, o) for s, o in zip(units, objs)], folder,
                 min(len(units), _usable_cores()))
        tmp_out = folder / output.name
        _run_all([link_command(cxx, objs, tmp_out)], folder, 1)
        os.replace(tmp_out, output)
    finally:
        _discard(folder)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tandem_kernels.build",
        description="Prebuild the fused CPU kernels for ISA levels, into a directory that "
                    "$TANDEM_PREBUILT_KERNELS names at run time (no compiler needed there).")
    parser.add_argument("--levels", default="all",
                        help=f"comma-separated, of {', '.join(lv.name for lv in LEVELS)}; or all (default: all)")
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_PREBUILT_DIR),
                        help=f"the directory to write into (default: {DEFAULT_PREBUILT_DIR})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not host_is_x86_64():
        parser.error(f"the levels are x86-64 ones and this machine is {platform.machine()}: prebuild them on "
                     "an x86-64 machine (here the kernels are built natively on first use)")
    try:
        levels = LEVELS if args.levels == "all" else [level_named(n.strip()) for n in args.levels.split(",")]
    except ValueError as error:
        parser.error(f"--levels: {error}")
    cxx = compiler()
    if cxx is None or shutil.which(cxx) is None:
        parser.error(f"no C++ compiler: {'CXX=' + cxx + ' is not found' if cxx else 'set CXX or install g++'}")
    host_flags = host_cpu_flags()
    for level in levels:
        output = args.out / library_name(level)
        missing = missing_flags(level, host_flags)
        note = f" (compile only: this machine lacks {', '.join(missing)})" if missing else ""
        start = time.monotonic()
        try:
            with build_lock(output):
                if output.exists():
                    logger.info("%s: %s is already built%s", level.name, output, note)
                    continue
                build(level, cxx, output)
        except (RuntimeError, OSError) as error:
            logger.error("%s: the build failed: %s", level.name, error)
            return 1
        logger.info("%s: built %s in %.0f s%s", level.name, output, time.monotonic() - start, note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
