"""The x86-64 instruction-set levels the CPU kernels are built for, and this CPU's level.

A library built for a level runs on every CPU that has all of the level's features, whatever
machine compiled it, so images can carry the kernels prebuilt (``tandem_kernels.build``). What the
sources in ``csrc/`` choose at compile time (their ``#if defined(__AVX512BF16__)`` and the like):

    avx2    x86-64-v3 (AVX2, FMA, F16C, BMI): the 8-lane paths (Intel Haswell+, AMD Zen 1+)
    avx512  x86-64-v4 (AVX-512 F/BW/CD/DQ/VL) + AVX-512 BF16, VNNI and VBMI: the 16-lane paths,
            bf16 dot products, VNNI int8, fp8 widening (AMD Zen 4+, Intel Sapphire Rapids+)
    amx     avx512 + AMX tiles (TILE, BF16, INT8): amx_linear.cpp (Intel Sapphire Rapids+)

A CPU with AVX-512 but without BF16 (Skylake-SP to Ice Lake) or without VBMI (Cooper Lake) gets
the avx2 build. Below avx2 (or not x86-64) there is no fused build: the plain-torch path runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class IsaLevel:
    name: str
    compile_flags: tuple[str, ...]  # what the compiler is told the target has (never -march=native)
    cpu_flags: frozenset[str] = field(repr=False)  # the /proc/cpuinfo flags a CPU needs, every one, to run the build


_X86_64_V3 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3",  # x86-64-v2
                        "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_AVX512 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",  # x86-64-v4
                        "avx512_bf16", "avx512_vnni", "avx512vbmi"}
_AMX = _AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}
_AVX512_FLAGS = ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi")

LEVELS = (  # lowest first: each runs wherever a later one does
    IsaLevel("avx2", ("-march=x86-64-v3",), _X86_64_V3),
    IsaLevel("avx512", _AVX512_FLAGS, _AVX512),
    IsaLevel("amx", (*_AVX512_FLAGS, "-mamx-tile", "-mamx-bf16", "-mamx-int8"), _AMX),
)


def level_named(name: str) -> IsaLevel:
    for level in LEVELS:
        if level.name == name:
            return level
    raise ValueError(f"unknown ISA level {name!r}: choose from {', '.join(lv.name for lv in LEVELS)}")


def missing_flags(level: IsaLevel, cpu_flags: frozenset[str]) -> list[str]:
    """The features ``level`` needs that a CPU with ``cpu_flags`` lacks (empty: it runs there)."""
    return sorted(level.cpu_flags - cpu_flags)


def highest_level(cpu_flags: frozenset[str]) -> Optional[IsaLevel]:
    """The highest level whose every feature is in ``cpu_flags``; None below avx2."""
    runnable = [level for level in LEVELS if not missing_flags(level, cpu_flags)]
    return runnable[-1] if runnable else None


def host_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (x86 "flags", Arm "Features"); empty elsewhere."""
    try:
        with open(cpuinfo) as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())
