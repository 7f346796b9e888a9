"""tandem_kernels.cpu.isa_peak (csrc/isa_peak.cpp): the peak rates of the kernels' dot-product
instructions that bench/ceiling.py prints. Which kinds a build has follows its ISA level; a kind it
lacks, an unknown kind or a bad duration is an error that says which. No rate is asserted beyond
being a positive finite number: speed is the benchmark's to print, never a test's to check."""

from __future__ import annotations

import math
import platform

import pytest

import tandem_kernels.cpu

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not tandem_kernels.cpu.available(), reason="needs the fused CPU kernels")]

BF16_LEVELS = ("avx512_bf16", "amx")  # the x86-64 levels built with AVX-512 BF16 (tandem_kernels.isa)


def expected_kinds() -> set[str]:
    level = tandem_kernels.cpu.loaded_library()[1].name
    if level == "native" and platform.machine().lower() not in ("x86_64", "amd64"):
        return set()  # no x86 vector instructions: every kind is refused
    if level == "native":
        pytest.skip("a native x86-64 build: which kinds it has depends on the compiler's own target")
    return {"int8", "fp32"} | ({"bf16"} if level in BF16_LEVELS else set())


def test_each_kind_the_build_has_gives_a_rate_and_the_others_are_refused_by_name():
    have = expected_kinds()
    for kind in tandem_kernels.cpu.ISA_PEAK_KINDS:
        if kind in have:
            rate = tandem_kernels.cpu.isa_peak(kind, 0.05)
            assert math.isfinite(rate) and rate > 0, (kind, rate)
        else:
            with pytest.raises(RuntimeError, match=f"no {kind}"):
                tandem_kernels.cpu.isa_peak(kind, 0.05)


@pytest.mark.parametrize("kind, seconds, message", [
    ("int4", 0.05, "kind must be int8, bf16 or fp32, got 'int4'"),
    ("fp32", 0.0, "seconds must be in"),
    ("fp32", 11.0, "seconds must be in"),
])
def test_an_unknown_kind_or_a_bad_duration_is_refused(kind, seconds, message):
    with pytest.raises(RuntimeError, match=message):
        tandem_kernels.cpu.isa_peak(kind, seconds)


def test_the_ceiling_bench_reports_the_kinds_the_build_has(monkeypatch):
    from bench import ceiling

    def build_without_bf16(kind: str, seconds: float) -> float:
        if kind == "bf16":
            raise RuntimeError("isa_peak: this build has no bf16 dot product (AVX-512 BF16)")
        return {"int8": 4.0, "fp32": 1.0}[kind]

    monkeypatch.setattr(tandem_kernels.cpu, "isa_peak", build_without_bf16)
    assert ceiling.dot_peaks() == {"int8": 4.0, "fp32": 1.0}
