"""The CPU kernels per ISA level (kernels/tandem_kernels/isa.py, build.py, cpu.py): this CPU's level
from its /proc/cpuinfo flags, each level's explicit compiler flags, library names keyed by the level
and never by the host, and prebuilt libraries that load where no compiler is.

The builds (avx2, which this machine runs, and amx, compiled only where the CPU lacks AMX) are made
once for the module by the prebuild command, `python -m tandem_kernels.build`; the libraries are
loaded in child processes, since one process can load only one build of the ops.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tandem_kernels.cpu as cpu
from tandem_kernels import build, isa

pytestmark = pytest.mark.timeout(1500)  # the module's two builds: ~1-2 min each on 2 busy cores

REPO_ROOT = Path(__file__).resolve().parents[1]
V3 = "fpu sse sse2 ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm xsave avx f16c fma abm movbe bmi1 bmi2 avx2"
V4 = "avx512f avx512bw avx512cd avx512dq avx512vl"
CPUS = {  # flag lines as Linux prints them (trimmed), and the level each gets
    "sandy bridge": ("fpu sse sse2 ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm xsave avx", None),
    "haswell": (f"{V3} rdrand", "avx2"),
    "zen 3": (f"{V3} sse4a sha_ni vaes", "avx2"),
    "ice lake (avx-512, no bf16)": (f"{V3} {V4} avx512_vnni avx512vbmi avx512ifma", "avx2"),
    "zen 4": (f"{V3} sse4a {V4} avx512ifma avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni", "avx512"),
    "sapphire rapids": (f"{V3} {V4} avx512_bf16 avx512vbmi avx512_vnni avx512_fp16 amx_bf16 amx_tile "
                        "amx_int8", "amx"),
    "sapphire rapids, amx_int8 hidden": (f"{V3} {V4} avx512_bf16 avx512vbmi avx512_vnni amx_bf16 amx_tile",
                                         "avx512"),
}
ARM = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid bf16 i8mm"


def fake_cpuinfo(tmp_path: Path, flags_line: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: Fake\n{flags_line}\nbogomips\t: 4000\n\n")
    return str(path)


@pytest.mark.parametrize("name", CPUS)
def test_the_level_is_the_highest_the_cpu_fully_supports(name, tmp_path):
    flags, expected = CPUS[name]
    level = isa.highest_level(isa.host_cpu_flags(fake_cpuinfo(tmp_path, f"flags\t\t: {flags}")))
    assert (level.name if level else None) == expected


def test_an_arm_cpu_has_no_level(tmp_path):
    flags = isa.host_cpu_flags(fake_cpuinfo(tmp_path, ARM))
    assert "asimd" in flags and isa.highest_level(flags) is None


@pytest.mark.parametrize("name", ["sandy bridge", "arm"])
def test_below_avx2_the_plain_torch_path_runs_and_the_warning_says_why(name, monkeypatch, caplog):
    flags = frozenset((ARM.partition(":")[2] if name == "arm" else CPUS[name][0]).split())
    monkeypatch.setattr(cpu, "host_cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu, "_state", {})  # decided afresh, and the real state restored after
    assert not cpu.available()
    reason = cpu.unavailable_reason()
    if name == "arm":
        assert "not x86-64" in reason
    else:
        assert "avx2 (x86-64-v3)" in reason and "abm, avx2, bmi1, bmi2, f16c, fma, movbe" in reason
    assert reason in caplog.text and "plain-torch path" in caplog.text


def test_a_lower_level_may_be_chosen_and_a_higher_one_is_refused(monkeypatch):
    monkeypatch.setattr(cpu, "host_cpu_flags", lambda: frozenset(CPUS["zen 4"][0].split()))
    assert cpu.host_level().name == "avx512"
    monkeypatch.setenv("TANDEM_CPU_KERNEL_LEVEL", "avx2")
    assert cpu.host_level().name == "avx2"
    monkeypatch.setenv("TANDEM_CPU_KERNEL_LEVEL", "amx")
    with pytest.raises(ValueError, match="TANDEM_CPU_KERNEL_LEVEL=amx: .*lacks amx_bf16, amx_int8, amx_tile"):
        cpu.host_level()
    monkeypatch.setenv("TANDEM_CPU_KERNEL_LEVEL", "avx1")
    with pytest.raises(ValueError, match="TANDEM_CPU_KERNEL_LEVEL: unknown ISA level 'avx1'"):
        cpu.host_level()


def test_each_level_compiles_for_its_target_not_for_this_machine():
    commands = {level.name: build.compile_command("c++", level, Path("a.cpp"), Path("a.o")) for level in isa.LEVELS}
    for command in commands.values():
        assert "-mtune=generic" in command
        assert not any(flag.startswith(("-march=native", "-mtune=native", "-mcpu=")) for flag in command)
        assert sum(flag.startswith("-march=") for flag in command) == 1
    assert "-march=x86-64-v3" in commands["avx2"] and not any("512" in f or "amx" in f for f in commands["avx2"])
    avx512 = ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi"]
    assert all(flag in commands["avx512"] for flag in avx512) and not any("amx" in f for f in commands["avx512"])
    assert all(flag in commands["amx"] for flag in [*avx512, "-mamx-tile", "-mamx-bf16", "-mamx-int8"])


def test_names_change_with_the_level_and_not_with_the_host(monkeypatch):
    """A build made on one machine is found on another of the same level: nothing of the host
    (its flags, its own level) is in the prebuilt name, nor in the cache's beyond the compiler."""
    def names():
        return [(build.library_name(lv), build.cached_library(lv, sys.executable).name) for lv in isa.LEVELS]

    first = names()
    assert len({name for pair in first for name in pair}) == 2 * len(isa.LEVELS)
    assert all(pre.startswith(f"tandem_cpu_ops-{lv.name}-") for (pre, _), lv in zip(first, isa.LEVELS))
    for flags in (CPUS["haswell"][0], CPUS["sapphire rapids"][0], ""):
        monkeypatch.setattr(isa, "host_cpu_flags", lambda flags=flags: frozenset(flags.split()))
        monkeypatch.setattr(cpu, "host_cpu_flags", lambda flags=flags: frozenset(flags.split()))
        assert names() == first


# ---- real builds ----------------------------------------------------------------------------

def child_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "CXX"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "kernels")])
    return {**env, **extra}


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> tuple[Path, str]:
    """(the directory, the command's log) of `python -m tandem_kernels.build --levels avx2,amx`."""
    if build.compiler() is None or isa.highest_level(isa.host_cpu_flags()) is None:
        pytest.skip("needs a C++ compiler and an x86-64 CPU with AVX2")
    out = tmp_path_factory.mktemp("prebuilt")
    proc = subprocess.run([sys.executable, "-m", "tandem_kernels.build", "--levels", "avx2,amx", "--out", str(out)],
                          env=child_env(), capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


def test_the_build_command_writes_each_level_and_says_which_it_cannot_run(prebuilt):
    out, log = prebuilt
    assert sorted(p.name for p in out.iterdir()) == sorted(build.library_name(isa.level_named(n))
                                                           for n in ("avx2", "amx"))
    amx_line = next(line for line in log.splitlines() if line.startswith("amx: built"))
    assert ("compile only: this machine lacks" in amx_line) == ("amx_tile" not in isa.host_cpu_flags())
    assert "compile only" not in next(line for line in log.splitlines() if line.startswith("avx2: built"))


def disassembly(library: Path) -> str:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed: the libraries' instructions cannot be read")
    return subprocess.run([objdump, "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                          check=True, timeout=300).stdout


def test_the_avx2_build_has_no_avx512_and_the_amx_build_has_tiles(prebuilt):
    out, _ = prebuilt
    avx2 = disassembly(out / build.library_name(isa.level_named("avx2")))
    assert "%ymm" in avx2 and "%zmm" not in avx2 and "tdpbf16ps" not in avx2
    amx = disassembly(out / build.library_name(isa.level_named("amx")))
    assert "%zmm" in amx and "tdpbf16ps" in amx and "ldtilecfg" in amx and "vdpbf16ps" in amx


CHILD = textwrap.dedent("""
    import logging, sys, torch
    logging.basicConfig(level=logging.INFO)
    import tandem_kernels.cpu as cpu
    from tandem_kernels import reference
    assert cpu.available(), cpu.unavailable_reason()
    library, level = cpu.loaded_library()
    print("loaded", level.name, library)
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(7, 300, generator=gen), torch.randn(300, generator=gen)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6),
                               atol=1e-6, rtol=1e-6)  # the sum's order differs
    logits = torch.randn(5, 1000, generator=gen).to(torch.bfloat16)
    assert torch.equal(cpu.argmax_rows(logits), reference.argmax_rows(logits))
    print("ops match")
""")


def run_child(out: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                          env=child_env(TANDEM_PREBUILT_KERNELS=str(out), TANDEM_KERNEL_CACHE=str(cache),
                                        CXX=str(tmp_path / "no-such-compiler"), **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ops match" in proc.stdout
    assert not cache.exists()  # nothing was compiled
    return proc


def test_the_prebuilt_avx2_library_loads_without_a_compiler_and_matches_the_reference(prebuilt, tmp_path):
    out, _ = prebuilt
    proc = run_child(out, tmp_path, TANDEM_CPU_KERNEL_LEVEL="avx2")
    assert f"loaded avx2 {out / build.library_name(isa.level_named('avx2'))}" in proc.stdout
    assert "loaded the prebuilt avx2 build" in proc.stderr


def test_without_the_hosts_level_prebuilt_nor_a_compiler_a_lower_prebuilt_level_loads(prebuilt, tmp_path):
    """This CPU's own level (auto), prebuilt or else the highest prebuilt one it can run."""
    out, _ = prebuilt
    host = isa.highest_level(isa.host_cpu_flags())
    expected = host.name if host.name in ("avx2", "amx") else "avx2"
    proc = run_child(out, tmp_path)
    assert f"loaded {expected} " in proc.stdout
    if expected != host.name:
        assert f"no prebuilt {host.name} library in {out} and no C++ compiler" in proc.stderr
        assert "using the prebuilt avx2 library (slower on this CPU)" in proc.stderr
