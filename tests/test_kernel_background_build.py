"""The CPU kernels found or built in the background at engine start (tandem_kernels.cpu.load_in_background)
and the build lock (tandem_kernels.build.build_lock): one build per library however many threads and
processes ask, the others wait for it and say so. The compiler and the build are faked (the real
build is covered by test_kernel_isa_levels.py and test_kernels_cpu.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
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
