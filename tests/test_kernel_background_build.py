"""The CPU kernels found or built in the background at engine start (tandem_kernels.cpu.load_in_background)
and the build lock (tandem_kernels.build.build_lock): one build per library however many threads and
processes ask, the others wait for it and say so; a build's scratch folder and compilers go however
it ends. The compiler (and mostly the build) are faked (the real build is covered by
test_kernel_isa_levels.py and test_kernels_cpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from test_kernel_isa_levels import CPUS, child_env, fake_compiler, fake_machine

import tandem_kernels.cpu as cpu
from backend.models.resolve import load_cpu_kernels_early
from backend.types.config import EngineConfig
from tandem_kernels import build, isa

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def slow_fake_build(monkeypatch, tmp_path):
    """An avx2 machine whose compiler is fake and whose build takes 0.5 s and records each call."""
    fake_machine(monkeypatch, "x86_64", CPUS["haswell"][0])
    monkeypatch.setattr(cpu, "_background", [])
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, ("-march=native",)))
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TANDEM_PREBUILT_KERNELS", str(tmp_path / "prebuilt"))
    builds, loaded = [], []

    def fake_build(level, cxx, output):
        builds.append(threading.current_thread().name)
        time.sleep(0.5)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(b"")

    monkeypatch.setattr(build, "build", fake_build)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    return builds, loaded


def test_a_background_build_is_waited_for_by_the_first_caller(slow_fake_build, caplog):
    builds, loaded = slow_fake_build
    caplog.set_level("INFO", logger=cpu.__name__)
    cpu.load_in_background()
    cpu.load_in_background()  # started once
    time.sleep(0.1)  # the thread holds the decision now
    assert cpu.available(), cpu.unavailable_reason()
    assert builds == ["tandem-cpu-kernels"] and len(loaded) == 1
    assert "Waiting for the CPU kernels" in caplog.text and "Waited " in caplog.text
    phase = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("[start-up] CPU kernels:"))
    assert "built and loaded the avx2 build" in phase and "in the background (" in phase
    cpu.load_in_background()  # decided: nothing more starts
    assert builds == ["tandem-cpu-kernels"] and len(cpu._background) == 1


def test_threads_asking_at_once_get_one_build_and_one_answer(slow_fake_build):
    builds, loaded = slow_fake_build
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(cpu.available())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [True] * 4 and len(builds) == 1 and len(loaded) == 1


def test_two_builders_of_one_library_build_it_once(slow_fake_build):
    """What two processes do (each its own decision), run here as two threads past the in-process lock:
    the second waits on the file lock, then finds the library built."""
    builds, _ = slow_fake_build
    level = isa.level_named("avx2")
    results = []
    threads = [threading.Thread(target=lambda: results.append(cpu._find_or_build(level))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1
    assert sorted(how for _, _, how in results) == ["built and loaded the",
                                                    "waited for another process's build, then loaded the"]
    assert results[0][0] == results[1][0]


def test_the_build_lock_excludes_another_process(tmp_path, caplog):
    output = tmp_path / "cache" / "lib.so"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from pathlib import Path
            from tandem_kernels import build
            with build.build_lock(Path({str(output)!r})):
                print("locked", flush=True)
                time.sleep(1.5)
        """)], env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        caplog.set_level("INFO", logger=build.__name__)
        start = time.monotonic()
        with build.build_lock(output):
            waited = time.monotonic() - start
    finally:
        holder.wait(30)
    assert waited > 0.5 and f"Waiting for another build of {output.name}" in caplog.text


def test_the_prebuild_command_skips_a_library_built_while_it_waited(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(build, "host_cpu_flags", lambda: frozenset(CPUS["haswell"][0].split()))
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, ("-march=native",)))
    monkeypatch.setattr(build, "build", lambda *args: pytest.fail("built twice"))
    output = tmp_path / "out" / build.library_name(isa.level_named("avx2"))
    output.parent.mkdir()
    output.write_bytes(b"")
    caplog.set_level("INFO", logger=build.__name__)
    assert build.main(["--levels", "avx2", "--out", str(output.parent)]) == 0
    assert "is already built" in caplog.text


def test_a_cpu_engine_starts_the_kernels_early_and_a_cuda_one_does_not(monkeypatch):
    started = []
    monkeypatch.setattr(cpu, "load_in_background", lambda: started.append(True))
    load_cpu_kernels_early(EngineConfig(device="cpu"))
    assert started == [True]
    load_cpu_kernels_early(EngineConfig(device="cuda"))
    assert started == [True]


def test_a_refused_level_is_raised_to_the_caller_not_lost_in_the_thread(slow_fake_build, monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_KERNEL_LEVEL", "amx")  # this fake avx2 CPU cannot run it
    cpu.load_in_background()
    cpu._background[0].join(10)
    with pytest.raises(ValueError, match="TANDEM_CPU_KERNEL_LEVEL=amx"):
        cpu.available()


def test_the_lock_file_sits_beside_the_library_under_another_name(tmp_path):
    output = tmp_path / "tandem_cpu_ops-avx2-0123.so"
    with build.build_lock(output):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["tandem_cpu_ops-avx2-0123.so.lock"]


# --- the scratch folder and the compilers, however a build ends -------------------------------------

def scratch_compiler(tmp_path: Path, fail: str = "", sleep: int = 0) -> str:
    """A compiler that fails on a command naming ``fail`` (once another has recorded its pid, or
    after 5 s), else records its pid in ``pids`` and sleeps ``sleep`` s (0: writes its -o file at once)."""
    script = tmp_path / "scratch-c++"
    script.write_text(f"""#!/bin/sh
out=""; prev=""
for a in "$@"; do
  case "$a" in --version) echo fake 1.0; exit 0;; esac
  [ "$prev" = "-o" ] && out="$a"; prev="$a"
done
case "$*" in *"{fail or '@never@'}"*)
  for _ in $(seq 50); do [ -s {tmp_path / "pids"} ] && break; sleep 0.1; done
  echo "fake: an error in {fail}" >&2; exit 1;; esac
echo $$ >> {tmp_path / "pids"}
[ {sleep} -gt 0 ] && exec sleep {sleep}
touch "$out"
""")
    script.chmod(0o755)
    return str(script)


def compiler_pids(tmp_path: Path) -> list[int]:
    path = tmp_path / "pids"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_failed_compile_stops_the_others_at_once_and_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "_usable_cores", lambda: 8)  # all compiles side by side, on any machine
    first = build.sources()[0].name
    output = tmp_path / "out" / "lib.so"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"an error in {first}"):
        build.build(isa.level_named("avx2"), scratch_compiler(tmp_path, fail=first, sleep=20), output)
    assert time.monotonic() - start < 10  # not waiting out the other compiles
    assert list(output.parent.iterdir()) == []
    assert compiler_pids(tmp_path) and not any(running(pid) for pid in compiler_pids(tmp_path))


def test_a_process_exiting_mid_build_stops_its_compilers_and_leaves_no_folder(tmp_path):
    """What a background build meets when the engine's start fails: the process exits under it."""
    output = tmp_path / "out" / "lib.so"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, threading, time
        from pathlib import Path
        from tandem_kernels import build, isa
        args = (isa.level_named("avx2"), {scratch_compiler(tmp_path, sleep=20)!r}, Path({str(output)!r}))
        threading.Thread(target=build.build, args=args, daemon=True).start()
        pids = Path({str(tmp_path / "pids")!r})
        while not (pids.exists() and pids.read_text().strip()):
            time.sleep(0.05)
        sys.exit(3)
    """)], env=child_env())
    try:
        assert child.wait(15) == 3
    finally:
        child.kill()
    assert list(output.parent.iterdir()) == []
    assert compiler_pids(tmp_path) and not any(running(pid) for pid in compiler_pids(tmp_path))


def test_a_folder_left_by_a_killed_build_is_removed_by_the_next_build(tmp_path):
    output = tmp_path / "out" / "lib.so"
    left = output.parent / f"{output.name}.build-k1ll3d"  # as a build killed outright leaves it
    left.mkdir(parents=True)
    (left / "attention.o").write_bytes(b"")
    other = output.parent / "other.so.build-k1ll3d"  # another library's: not this build's to remove
    other.mkdir()
    build.build(isa.level_named("avx2"), scratch_compiler(tmp_path), output)
    assert sorted(p.name for p in output.parent.iterdir()) == ["lib.so", "other.so.build-k1ll3d"]
