"""backend.models.huge_pages: a CPU model's large mappings moved onto 2 MB pages, contents unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from backend.models import huge_pages
from backend.models.huge_pages import large_anonymous_mappings


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
from backend.models.huge_pages import collapse_large_mappings, huge_pages_enabled
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
from backend.models.huge_pages import advise_huge_pages, huge_pages_enabled
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


def test_a_zeroed_tensor_reads_zeros_is_writable_and_costs_no_memory_until_written():
    """The KV cache's allocation: zeros without writing them (a 256 MB cache adds almost nothing
    resident), on 2 MB pages once written, one copy (the tensor is the mapping)."""
    script = """
import torch
from backend.models.huge_pages import huge_pages_enabled, zeroed_tensor
from test_huge_pages import anon_huge_bytes

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

before = resident()
cache = zeroed_tensor((64, 1024, 1024), torch.float32)  # 256 MB
allocated = resident() - before
assert cache.shape == (64, 1024, 1024) and cache.dtype == torch.float32 and cache.is_contiguous()
huge_before = anon_huge_bytes()
cache[:8].fill_(3.0)  # 32 MB written
written = anon_huge_bytes() - huge_before
zeros = int(torch.count_nonzero(cache[8:]).item() == 0)  # read: maps the shared zero page
threes = int(bool((cache[:8] == 3.0).all()))
print(int(huge_pages_enabled()), allocated, written, zeros, threes, cache.data_ptr() % (2 << 20))
"""
    enabled, allocated, written, zeros, threes, misalignment = run_fresh(script)
    assert zeros and threes
    assert allocated < 16 << 20  # nothing written: nothing resident (a zeroed copy would be 256 MB)
    assert misalignment == 0
    if enabled:
        assert written >= 16 << 20


def test_a_zeroed_tensor_is_its_mapping_and_frees_it_with_its_last_view():
    """No second copy: a write through one view is seen through another, and the mapping goes
    when the last tensor over it does."""
    script = """
import gc
import torch
from backend.models.huge_pages import zeroed_tensor

def mapped(address):
    with open("/proc/self/maps") as f:
        spans = [line.split()[0].split("-") for line in f]
    return int(any(int(lo, 16) <= address < int(hi, 16) for lo, hi in spans))

cache = zeroed_tensor((4, 1 << 20), torch.bfloat16)
row = cache[2]
cache[2, 5] = 7.0
seen = int(row[5].item() == 7.0 and cache.untyped_storage().data_ptr() == row.untyped_storage().data_ptr())
address = cache.data_ptr()
del cache
gc.collect()
still = mapped(address)
del row
gc.collect()
print(seen, still, mapped(address))
"""
    seen, still_mapped_with_a_view, mapped_after = run_fresh(script)
    assert seen == 1
    assert still_mapped_with_a_view == 1
    assert mapped_after == 0


def test_collapsing_leaves_the_skipped_ranges_whole_huge_pages_alone(monkeypatch):
    """An embedding table a step only gathers rows of is skipped: MADV_COLLAPSE is asked for every
    whole 2 MB page of each large mapping except those inside a skipped range (a 2 MB page that
    the range only partly covers holds other memory too, and is collapsed)."""
    mb = 1 << 20
    asked = []

    def madvise(start, length, advice):
        asked.append((start, start + length, advice))
        return 0

    monkeypatch.setattr(huge_pages, "huge_pages_enabled", lambda: True)
    monkeypatch.setattr(huge_pages, "_madvise", lambda: madvise)
    # Two mappings: [1 MB, 41 MB) holds a table at [5 MB, 21 MB) and [100 MB, 110 MB) none.
    monkeypatch.setattr(huge_pages, "large_anonymous_mappings", lambda min_bytes: [(1 * mb, 41 * mb), (100 * mb, 110 * mb)])
    collapsed = huge_pages.collapse_large_mappings(skip=[(5 * mb, 16 * mb)])
    expected = [(2 * mb, 6 * mb), (20 * mb, 40 * mb), (100 * mb, 110 * mb)]  # table's whole pages: [6, 20) MB
    assert asked == [(lo, hi, huge_pages.MADV_COLLAPSE) for lo, hi in expected]
    assert collapsed == sum(hi - lo for lo, hi in expected)
    asked.clear()
    huge_pages.collapse_large_mappings(skip=[(0, 200 * mb)])  # everything skipped
    assert asked == []


def test_copies_in_one_arena_equal_their_sources_and_lie_aligned_in_one_mapping_on_huge_pages():
    script = """
import torch
from backend.models.huge_pages import copies_in_one_arena, huge_pages_enabled
from test_huge_pages import anon_huge_bytes

sources = [torch.randint(0, 255, (6 << 20,), dtype=torch.uint8), torch.randn(3, 5).half(),
           torch.randn(1000, 700)[:, ::7], torch.zeros(0, 4)]
before = anon_huge_bytes()
copies = copies_in_one_arena(sources)
huge = anon_huge_bytes() - before
equal = int(all(c.shape == s.shape and c.dtype == s.dtype and torch.equal(c, s) for c, s in zip(copies, sources)))
one_storage = int(len({c.untyped_storage().data_ptr() for c in copies if c.numel()}) == 1)
aligned = int(all(c.data_ptr() % 64 == 0 for c in copies if c.numel()))
held = [c for c in copies if c.numel()]  # an empty tensor's pointer says nothing
apart = int(all(a.data_ptr() + a.nbytes <= b.data_ptr() for a, b in zip(held, held[1:])))
print(int(huge_pages_enabled()), equal, one_storage, aligned, apart, huge)
"""
    enabled, equal, one_storage, aligned, apart, huge = run_fresh(script)
    assert equal and one_storage and aligned and apart
    if enabled:
        assert huge >= 4 << 20  # the 6 MB copy's whole 2 MB pages
