"""backend.worker.huge_pages: a CPU model's large mappings moved onto 2 MB pages, contents unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from backend.worker.huge_pages import large_anonymous_mappings


def anon_huge_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages:"))


def run_fresh(script: str) -> list[int]:
    """The integers ``script`` prints, run in a fresh process (in this one, earlier engines'
    collapsed memory may already hold a new tensor)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [int(x) for x in result.stdout.split()]


def test_a_large_tensor_is_in_the_mappings_found():
    weights = torch.randn(8 << 20)  # 32 MB, touched
    start = weights.data_ptr()
    spans = large_anonymous_mappings(4 << 20)
    assert any(lo <= start and start + weights.nbytes <= hi for lo, hi in spans)


def test_collapsing_moves_a_touched_tensor_onto_huge_pages_and_keeps_its_values():
    script = """
import torch
from backend.worker.huge_pages import collapse_large_mappings, huge_pages_enabled
from test_huge_pages import anon_huge_bytes
weights = torch.randn(8 << 20)  # 32 MB, touched
expected = weights.clone()
before = anon_huge_bytes()
collapsed = collapse_large_mappings()
print(int(huge_pages_enabled()), collapsed, anon_huge_bytes() - before, int(torch.equal(weights, expected)))
"""
    enabled, collapsed, grown, equal = run_fresh(script)
    if enabled:  # this machine: THP "madvise", Linux 6.x
        assert collapsed >= 16 << 20 and grown >= 16 << 20
    else:
        assert collapsed == 0
    assert equal


def test_memory_advised_before_it_is_touched_faults_in_on_huge_pages():
    """The KV cache's allocation: advised while fresh, then zeroed."""
    script = """
import torch
from backend.worker.huge_pages import advise_huge_pages, huge_pages_enabled
from test_huge_pages import anon_huge_bytes
cache = torch.empty(8 << 20)  # 32 MB, not yet touched
before = anon_huge_bytes()
advised = advise_huge_pages(cache.data_ptr(), cache.nbytes)
cache.zero_()
print(int(huge_pages_enabled()), int(advised), anon_huge_bytes() - before)
"""
    enabled, advised, grown = run_fresh(script)
    assert advised == enabled
    if enabled:
        assert grown >= 16 << 20
