"""The x86-64 instruction-set levels the CPU kernels are built for, this CPU's level, and the
``native`` build for CPUs that are not x86-64.

A library built for an x86-64 level runs on every CPU that has all of the level's features,
whatever machine compiled it, so images can carry the kernels prebuilt (``tandem_kernels.build``).
What the sources in ``csrc/`` choose at compile time (their ``#if defined(__AVX512BF16__)`` and the
like):

    avx2         x86-64-v3 (AVX2, FMA, F16C, BMI): the 8-lane paths (Intel Haswell+, AMD Zen 1+)
    avx512       x86-64-v4 (AVX-512 F/BW/CD/DQ/VL): the 16-lane paths with fp32 arithmetic
                 (Intel Skylake-SP and later)
    avx512_vnni  avx512 + AVX-512 VNNI: the int8 x int8 matmul's VNNI kernel (Intel Cascade Lake,
                 Ice Lake server, Cooper Lake)
    avx512_bf16  avx512_vnni + AVX-512 BF16 and VBMI: bf16 dot products in attention, the bf16
                 matmuls (bf16_linear.cpp) and the int8 / int4 ones, fp8 caches widened to bf16
                 (AMD Zen 4+, Intel Sapphire Rapids+)
    amx          avx512_bf16 + AMX tiles (TILE, BF16, INT8): amx_linear.cpp (Intel Sapphire Rapids+)

Cooper Lake has BF16 but not VBMI, so it runs avx512_vnni. Below avx2 there is no fused build: the
plain-torch path runs. A CPU that is not x86-64 (Arm, ...) gets ``NATIVE``: built on that machine
for that machine (the compiler's own target, ``build.native_flags``), never prebuilt.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class IsaLevel:
    name: str
    # What the compiler is told the target has (never -march=native; NATIVE's: build.native_flags).
    compile_flags: tuple[str, ...]
    cpu_flags: frozenset[str] = field(repr=False)  # the /proc/cpuinfo flags a CPU needs, every one, to run the build


_X86_64_V3 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3",  # x86-64-v2
                        "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_VNNI = _V4 | {"avx512_vnni"}
_BF16 = _VNNI | {"avx512_bf16", "avx512vbmi"}
_AMX = _BF16 | {"amx_tile", "amx_bf16", "amx_int8"}
_GENERIC = ("-mtune=generic",)  # tuned for no one CPU: the library runs on a whole level
_V4_FLAGS = (*_GENERIC, "-march=x86-64-v4")
_VNNI_FLAGS = (*_V4_FLAGS, "-mavx512vnni")
_BF16_FLAGS = (*_VNNI_FLAGS, "-mavx512bf16", "-mavx512vbmi")

LEVELS = (  # lowest first: each runs wherever a later one does
    IsaLevel("avx2", (*_GENERIC, "-march=x86-64-v3"), _X86_64_V3),
    IsaLevel("avx512", _V4_FLAGS, _V4),
    IsaLevel("avx512_vnni", _VNNI_FLAGS, _VNNI),
    IsaLevel("avx512_bf16", _BF16_FLAGS, _BF16),
    IsaLevel("amx", (*_BF16_FLAGS, "-mamx-tile", "-mamx-bf16", "-mamx-int8"), _AMX),
)

# Not x86-64: this machine's own target, the flags found by asking the compiler at build time.
NATIVE = IsaLevel("native", (), frozenset())


def level_named(name: str) -> IsaLevel:
    """One of ``LEVELS`` by name (``native`` is none of them: it is never chosen by name)."""
    for level in LEVELS:
        if level.name == name:
            return level
    if name == NATIVE.name:
        raise ValueError("native is not an x86-64 level: a CPU that is not x86-64 builds it for itself, and "
                         f"nothing else does; choose from {', '.join(lv.name for lv in LEVELS)}")
    raise ValueError(f"unknown ISA level {name!r}: choose from {', '.join(lv.name for lv in LEVELS)}")


def missing_flags(level: IsaLevel, cpu_flags: frozenset[str]) -> list[str]:
    """The features ``level`` needs that a CPU with ``cpu_flags`` lacks (empty: it runs there)."""
    return sorted(level.cpu_flags - cpu_flags)


def highest_level(cpu_flags: frozenset[str]) -> Optional[IsaLevel]:
    """The highest x86-64 level whose every feature is in ``cpu_flags``; None below avx2."""
    runnable = [level for level in LEVELS if not missing_flags(level, cpu_flags)]
    return runnable[-1] if runnable else None


def host_is_x86_64() -> bool:
    """Whether this machine runs x86-64 code (``LEVELS``), as Python was built for it."""
    return platform.machine().lower() in ("x86_64", "amd64")


def host_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (x86 "flags", Arm "Features"); empty elsewhere."""
    try:
        with open(cpuinfo) as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())
