"""backend.huge_pages: a CPU model's large mappings moved onto 2 MB pages, contents unchanged."""

from __future__ import annotations

import torch

from backend.huge_pages import collapse_large_mappings, huge_pages_enabled, large_anonymous_mappings


def anon_huge_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages:"))


def test_a_large_tensor_is_in_the_mappings_found():
    weights = torch.randn(8 << 20)  # 32 MB, touched
    start = weights.data_ptr()
    spans = large_anonymous_mappings(4 << 20)
    assert any(lo <= start and start + weights.nbytes <= hi for lo, hi in spans)


def test_collapsing_moves_a_touched_tensor_onto_huge_pages_and_keeps_its_values():
    weights = torch.randn(8 << 20)
    expected = weights.clone()
    before = anon_huge_bytes()
    collapsed = collapse_large_mappings()
    if huge_pages_enabled():  # this machine: THP "madvise", Linux 6.x
        assert collapsed >= 16 << 20
        assert anon_huge_bytes() - before >= 16 << 20
    else:
        assert collapsed == 0
    assert torch.equal(weights, expected)
