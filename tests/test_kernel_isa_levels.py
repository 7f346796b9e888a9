"""The CPU kernels per ISA level (kernels/tandem_kernels/isa.py, build.py, cpu.py): this CPU's level
from its /proc/cpuinfo flags, each level's explicit compiler flags, library names keyed by the level
and never by the host, prebuilt libraries that load where no compiler is, and the native build of a
CPU that is not x86-64 (faked here: the machine, its flags and its compiler).

The builds (avx2; avx512 and avx512_vnni, whose paths without BF16 this machine runs when it has
AVX-512; amx, compiled only where the CPU lacks AMX) are made once for the module by the prebuild
command, `python -m tandem_kernels.build`; the libraries are loaded in child processes, since one
process can load only one build of the ops.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tandem_kernels.cpu as cpu
from tandem_kernels import build, isa

pytestmark = pytest.mark.timeout(2400)  # the module's four builds: ~1-2 min each on 2 busy cores

REPO_ROOT = Path(__file__).resolve().parents[1]
V3 = "fpu sse sse2 ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm xsave avx f16c fma abm movbe bmi1 bmi2 avx2"
V4 = "avx512f avx512bw avx512cd avx512dq avx512vl"
CPUS = {  # flag lines as Linux prints them (trimmed), and the level each gets
    "sandy bridge": ("fpu sse sse2 ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm xsave avx", None),
    "haswell": (f"{V3} rdrand", "avx2"),
    "zen 3": (f"{V3} sse4a sha_ni vaes", "avx2"),
    "skylake-sp": (f"{V3} {V4} clflushopt clwb pku", "avx512"),
    "cascade lake": (f"{V3} {V4} avx512_vnni pku", "avx512_vnni"),
    "ice lake server": (f"{V3} {V4} avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg", "avx512_vnni"),
    "cooper lake (bf16, no vbmi)": (f"{V3} {V4} avx512_vnni avx512_bf16", "avx512_vnni"),
    "zen 4": (f"{V3} sse4a {V4} avx512ifma avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni", "avx512_bf16"),
    "sapphire rapids": (f"{V3} {V4} avx512_bf16 avx512vbmi avx512_vnni avx512_fp16 amx_bf16 amx_tile "
                        "amx_int8", "amx"),
    "sapphire rapids, amx_int8 hidden": (f"{V3} {V4} avx512_bf16 avx512vbmi avx512_vnni amx_bf16 amx_tile",
                                         "avx512_bf16"),
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


def test_an_arm_cpu_has_no_x86_level(tmp_path):
    flags = isa.host_cpu_flags(fake_cpuinfo(tmp_path, ARM))
    assert "asimd" in flags and isa.highest_level(flags) is None


def fake_machine(monkeypatch, machine: str, flags: str) -> None:
    """This process sees another machine: its architecture and its /proc/cpuinfo flags; the kernels'
    state is decided afresh (and the real one restored after the test)."""
    monkeypatch.setattr(platform, "machine", lambda: machine)
    for module in (cpu, build):
        monkeypatch.setattr(module, "host_cpu_flags", lambda: frozenset(flags.split()))
    monkeypatch.setattr(cpu, "_state", {})
    monkeypatch.delenv("TANDEM_CPU_KERNEL_LEVEL", raising=False)
    monkeypatch.delenv("TANDEM_CPU_KERNELS", raising=False)


def test_an_x86_cpu_below_avx2_runs_the_plain_torch_path_and_the_warning_says_why(monkeypatch, caplog):
    fake_machine(monkeypatch, "x86_64", CPUS["sandy bridge"][0])
    monkeypatch.setattr(build, "build", lambda *args: pytest.fail("nothing is built below avx2"))
    assert cpu.host_level() is None and not cpu.available()
    reason = cpu.unavailable_reason()
    assert "avx2 (x86-64-v3)" in reason and "abm, avx2, bmi1, bmi2, f16c, fma, movbe" in reason
    assert reason in caplog.text and "plain-torch path" in caplog.text


def fake_compiler(tmp_path: Path, accepts: tuple[str, ...]) -> str:
    """A compiler that takes of -march=native / -mcpu=native only ``accepts``, and compiles nothing."""
    refused = [flag for flag in ("-march=native", "-mcpu=native") if flag not in accepts]
    script = tmp_path / f"fake-c++-{len(accepts)}-{'-'.join(a.strip('-') for a in accepts)}"
    cases = "".join(f"    {flag}) echo 'unrecognized {flag}' >&2; exit 1;;\n" for flag in refused)
    script.write_text(f'#!/bin/sh\nfor a in "$@"; do\n  case "$a" in\n    --version) echo fake 1.0; exit 0;;\n'
                      f'{cases}  esac\ndone\nexit 0\n')
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("machine", ["aarch64", "x86_64", "ppc64le"])
@pytest.mark.parametrize("accepts", [("-march=native", "-mcpu=native"), ("-mcpu=native",), ("-march=native",), ()])
def test_the_native_target_is_the_first_flag_the_compiler_takes(machine, accepts, monkeypatch, tmp_path):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    cxx = fake_compiler(tmp_path, accepts)
    preferred = "-mcpu=native" if machine == "aarch64" else "-march=native"  # Arm's -mcpu also tunes
    expected = () if not accepts else (preferred,) if preferred in accepts else accepts
    assert build.native_flags(cxx) == expected
    command = build.compile_command(cxx, isa.NATIVE, Path("a.cpp"), Path("a.o"))
    assert [f for f in command if f.startswith(("-march", "-mcpu", "-mtune"))] == list(expected)


def test_this_compiler_takes_a_native_flag():
    cxx = build.compiler()
    if cxx is None or shutil.which(cxx) is None:
        pytest.skip("needs a C++ compiler")
    assert build.native_flags(cxx) in (("-march=native",), ("-mcpu=native",))


def test_the_native_flag_probe_writes_no_file(tmp_path):
    """A probe killed with its process leaves nothing behind: it only checks the source's syntax."""
    record = tmp_path / "args"
    cxx = tmp_path / "recording-c++"
    cxx.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {record}\nexit 0\n')
    cxx.chmod(0o755)
    assert build.native_flags(str(cxx)) in (("-march=native",), ("-mcpu=native",))
    args = record.read_text().split()
    assert "-fsyntax-only" in args and "-o" not in args and "-c" not in args


def test_a_cpu_that_is_not_x86_64_builds_its_native_kernels_into_the_cache(monkeypatch, tmp_path, caplog):
    """Never looked for among the prebuilt ones; cached under a name of its machine and its flags; the
    build itself is faked (the real one is -march=native's, which this machine's own tests cover)."""
    fake_machine(monkeypatch, "aarch64", ARM.partition(":")[2])
    cxx = fake_compiler(tmp_path, ("-mcpu=native",))
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TANDEM_PREBUILT_KERNELS", str(tmp_path / "prebuilt"))
    built, loaded = [], []
    monkeypatch.setattr(build, "build", lambda level, cxx, output: (built.append((level, output)),
                                                                    output.parent.mkdir(parents=True, exist_ok=True),
                                                                    output.write_bytes(b"")))
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    caplog.set_level("INFO", logger=cpu.__name__)
    assert cpu.host_level() is isa.NATIVE
    assert cpu.available(), cpu.unavailable_reason()
    [(level, library)] = built
    assert level is isa.NATIVE and loaded == [str(library)] and cpu.loaded_library() == (library, isa.NATIVE)
    assert library.parent == tmp_path / "cache" and library.name.startswith("tandem_cpu_ops-native-")
    assert "Building Tandem's CPU kernels for native (-mcpu=native)" in caplog.text
    with pytest.raises(ValueError, match="never prebuilt"):
        build.library_name(isa.NATIVE)
    # The name is the machine's: another CPU's flags (a shared home) or another machine build anew.
    monkeypatch.setattr(build, "host_cpu_flags", lambda: frozenset({"fp", "asimd"}))
    assert build.cached_library(isa.NATIVE, cxx) != library
    monkeypatch.setattr(build, "host_cpu_flags", lambda: frozenset(ARM.partition(":")[2].split()))
    assert build.cached_library(isa.NATIVE, cxx) == library
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    assert build.cached_library(isa.NATIVE, cxx) != library


def test_a_cpu_that_is_not_x86_64_without_a_compiler_runs_the_plain_torch_path(monkeypatch, tmp_path, caplog):
    fake_machine(monkeypatch, "aarch64", ARM.partition(":")[2])
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert not cpu.available()
    assert "this aarch64 CPU's kernels are built on it (never prebuilt) and no C++ compiler" in cpu.unavailable_reason()
    assert "plain-torch path" in caplog.text


def test_a_cpu_that_is_not_x86_64_refuses_x86_levels_and_prebuilding(monkeypatch, capsys):
    fake_machine(monkeypatch, "aarch64", ARM.partition(":")[2])
    monkeypatch.setenv("TANDEM_CPU_KERNEL_LEVEL", "avx2")
    with pytest.raises(ValueError, match="TANDEM_CPU_KERNEL_LEVEL=avx2: this CPU is not x86-64 \\(aarch64\\)"):
        cpu.host_level()
    with pytest.raises(SystemExit):
        build.main(["--levels", "avx2", "--out", "unused"])
    assert "the levels are x86-64 ones and this machine is aarch64" in capsys.readouterr().err


def test_a_lower_level_may_be_chosen_and_a_higher_one_is_refused(monkeypatch):
    fake_machine(monkeypatch, "x86_64", CPUS["zen 4"][0])
    assert cpu.host_level().name == "avx512_bf16"
    for lower in ("avx2", "avx512", "avx512_vnni"):
        monkeypatch.setenv("TANDEM_CPU_KERNEL_LEVEL", lower)
        assert cpu.host_level().name == lower
    monkeypatch.setenv("TANDEM_CPU_KERNEL_LEVEL", "amx")
    with pytest.raises(ValueError, match="TANDEM_CPU_KERNEL_LEVEL=amx: .*lacks amx_bf16, amx_int8, amx_tile"):
        cpu.host_level()
    monkeypatch.setenv("TANDEM_CPU_KERNEL_LEVEL", "avx1")
    with pytest.raises(ValueError, match="TANDEM_CPU_KERNEL_LEVEL: unknown ISA level 'avx1'"):
        cpu.host_level()
    monkeypatch.setenv("TANDEM_CPU_KERNEL_LEVEL", "native")  # only a CPU that is not x86-64 builds it
    with pytest.raises(ValueError, match="native is not an x86-64 level"):
        cpu.host_level()


def test_each_level_compiles_for_its_target_not_for_this_machine():
    commands = {level.name: build.compile_command("c++", level, Path("a.cpp"), Path("a.o")) for level in isa.LEVELS}
    for command in commands.values():
        assert "-mtune=generic" in command
        assert not any(flag.startswith(("-march=native", "-mtune=native", "-mcpu=")) for flag in command)
        assert sum(flag.startswith("-march=") for flag in command) == 1
    targets = {name: [f for f in command if f.startswith("-m") and f != "-mtune=generic"]
               for name, command in commands.items()}
    bf16 = ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mavx512vbmi"]
    assert targets == {"avx2": ["-march=x86-64-v3"], "avx512": ["-march=x86-64-v4"],
                       "avx512_vnni": ["-march=x86-64-v4", "-mavx512vnni"], "avx512_bf16": bf16,
                       "amx": [*bf16, "-mamx-tile", "-mamx-bf16", "-mamx-int8"]}


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


BUILT = "avx2,avx512,avx512_vnni,amx"  # avx512_bf16 is this machine's own in test_kernels_cpu.py


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> tuple[Path, str]:
    """(the directory, the command's log) of `python -m tandem_kernels.build --levels` BUILT."""
    if build.compiler() is None or not isa.host_is_x86_64() or isa.highest_level(isa.host_cpu_flags()) is None:
        pytest.skip("needs a C++ compiler and an x86-64 CPU with AVX2")
    out = tmp_path_factory.mktemp("prebuilt")
    proc = subprocess.run([sys.executable, "-m", "tandem_kernels.build", "--levels", BUILT, "--out", str(out)],
                          env=child_env(), capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


def test_the_build_command_writes_each_level_and_says_which_it_cannot_run(prebuilt):
    out, log = prebuilt
    assert sorted(p.name for p in out.glob("*.so")) == sorted(build.library_name(isa.level_named(n))
                                                           for n in BUILT.split(","))
    amx_line = next(line for line in log.splitlines() if line.startswith("amx: built"))
    assert ("compile only: this machine lacks" in amx_line) == ("amx_tile" not in isa.host_cpu_flags())
    assert "compile only" not in next(line for line in log.splitlines() if line.startswith("avx2: built"))


def disassembly(library: Path) -> str:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed: the libraries' instructions cannot be read")
    return subprocess.run([objdump, "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                          check=True, timeout=300).stdout


def test_each_build_has_its_levels_instructions_and_none_above(prebuilt):
    out, _ = prebuilt

    def code(name):
        return disassembly(out / build.library_name(isa.level_named(name)))

    avx2 = code("avx2")
    assert "%ymm" in avx2 and "%zmm" not in avx2 and "tdpbf16ps" not in avx2
    avx512 = code("avx512")  # 16 lanes in fp32: no VNNI, no bf16 dot products
    assert "%zmm" in avx512 and "vpdpbusd" not in avx512 and "vdpbf16ps" not in avx512
    vnni = code("avx512_vnni")  # w8a8_packed.cpp's VNNI kernel, still no bf16
    assert "vpdpbusd" in vnni and "vdpbf16ps" not in vnni
    amx = code("amx")  # every AVX-512 path too, VBMI's fp8 widening (a byte permute) among them
    assert "%zmm" in amx and "tdpbf16ps" in amx and "ldtilecfg" in amx and "vdpbf16ps" in amx
    assert "vpdpbusd" in amx and ("vpermi2b" in amx or "vpermt2b" in amx)


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
    built = BUILT.split(",")
    expected = [lv.name for lv in isa.LEVELS[:isa.LEVELS.index(host) + 1] if lv.name in built][-1]
    proc = run_child(out, tmp_path)
    assert f"loaded {expected} " in proc.stdout
    if expected != host.name:
        assert f"no prebuilt {host.name} library in {out} and no C++ compiler" in proc.stderr
        assert f"using the prebuilt {expected} library (slower on this CPU)" in proc.stderr


@pytest.mark.parametrize("name", ["avx2", "avx512", "avx512_vnni"])
def test_each_lower_prebuilt_level_passes_the_kernel_tests(name, prebuilt, tmp_path):
    """tests/test_kernels_cpu.py against the level's prebuilt library: the paths a CPU of that level
    takes (8 lanes; 16 lanes in fp32 without VNNI nor BF16; VNNI without BF16) match the reference."""
    out, _ = prebuilt
    if missing := isa.missing_flags(isa.level_named(name), isa.host_cpu_flags()):
        pytest.skip(f"this CPU cannot run {name} (it lacks {', '.join(missing)})")
    cache = tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "not editing",
         str(REPO_ROOT / "tests" / "test_kernels_cpu.py")], capture_output=True, text=True, timeout=900,
        cwd=REPO_ROOT, env=child_env(TANDEM_PREBUILT_KERNELS=str(out), TANDEM_KERNEL_CACHE=str(cache),
                                     CXX=str(tmp_path / "no-such-compiler"), TANDEM_CPU_KERNEL_LEVEL=name))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout and not cache.exists()
    assert "needs a CPU with AVX-512 BF16" in proc.stdout  # no level here has the bf16 kernels
    assert "needs a CPU with AVX-512 VNNI" not in proc.stdout  # w8a8's packed kernel runs at every level
