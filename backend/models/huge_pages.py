"""A CPU model's weights and KV cache on 2 MB pages (Linux transparent huge pages).

A batch-1 decode step streams every weight once. On 4 KB pages each page is a TLB miss and the
hardware prefetchers stop at each page's end; on 2 MB pages the 2-core CPU's batch-1 step took
19.5-20.0 ms instead of 22.1-22.4 (w8a8) and 51-53 ms instead of 59-64 (fp32). oneDNN's packed
weights are opaque tensors (no data pointer), so instead of placing tensors this collapses the
process's large anonymous mappings, where the weights live, with ``MADV_COLLAPSE`` (Linux 6.1+):
what is populated now moves, later faults keep 4 KB pages (so memory that grows under traffic
grows as before). Elsewhere (THP ``never``, older kernels, not Linux) it does nothing.

Weights a model would keep in a file mapping (the GGUF repack caches, read with ``torch.load(...,
mmap=True)``) sit on 4 KB page-cache pages that no collapse moves: ``copies_in_one_arena`` copies
them into one 2 MB-aligned anonymous arena instead (a 1B file's batch-1 decode, alternating runs
on a 2-core AMD EPYC: Q4_K_M 27.3-35.7 ms a token from the mapping, 20.8-30.3 from the arena, ~10 %
by the medians; Q4_1 27.1-33.9 and 19.4-23.3; start-up 1-2 s longer for the ~850 MB).

The KV cache is asked for 2 MB pages before it is first written (``MADV_HUGEPAGE``): attention
reads each sequence's blocks, 2 KB runs that churn scatters over a cache of up to gigabytes, and on
4 KB pages nearly every run is a TLB miss (batch-32 attention, 200 tokens each, blocks scattered
over 24 MB per layer: 8.8 ms on 4 KB pages, 6.4 ms on 2 MB ones; with each sequence's blocks
adjacent, as in a fresh engine, the same within noise). ``zeroed_tensor`` allocates it: a private
anonymous mapping of its own, 2 MB-aligned, which the kernel zero-fills page by page on first touch,
so a start-up does not write gigabytes of zeros (2 GiB took 2.2 s) and an engine's untouched blocks
use no memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys
from typing import Iterable

import torch

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_enabled() -> bool:
    """Linux with transparent huge pages on ``madvise`` or ``always``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open(THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return False
    return "[madvise]" in setting or "[always]" in setting


def large_anonymous_mappings(min_bytes: int) -> list[tuple[int, int]]:
    """(start, end) of this process's private, writable, file-less mappings of >= min_bytes."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            span, perms = fields[0], fields[1]
            path = fields[5] if len(fields) > 5 else ""
            if not perms.startswith("rw") or perms[3] != "p" or (path and path != "[heap]"):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            if end - start >= min_bytes:
                spans.append((start, end))
    return spans


@functools.cache
def _madvise():
    """libc's madvise (loaded once: the KV cache advises each layer's K and V)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def _whole_huge_pages(start: int, end: int) -> tuple[int, int]:
    """The 2 MB-aligned part [first, last) of [start, end); empty when last <= first."""
    return -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE


def advise_huge_pages(start: int, nbytes: int) -> bool:
    """Ask for 2 MB pages under the memory [start, start + nbytes) where it is not yet touched
    (the aligned 2 MB pages inside it, faulted later); True if the kernel took the advice."""
    if not huge_pages_enabled():
        return False
    first, last = _whole_huge_pages(start, start + nbytes)
    return last > first and _madvise()(first, last - first, MADV_HUGEPAGE) == 0


def collapse_large_mappings(min_bytes: int = 4 << 20, skip: Iterable[tuple[int, int]] = ()) -> int:
    """Move the populated parts of every large anonymous mapping onto 2 MB pages, except the whole
    2 MB pages inside the ``skip`` ranges ((start, nbytes): memory a step only gathers a few rows
    of, such as an embedding table, which gains nothing and took 0.85 s of a 1B model's start-up);
    returns the bytes the kernel collapsed (0 where huge pages are unavailable). Best effort: a
    range the kernel cannot collapse (memory pressure, a page in use elsewhere) stays as it is."""
    if not huge_pages_enabled():
        return 0
    madvise = _madvise()
    holes = sorted(_whole_huge_pages(start, start + nbytes) for start, nbytes in skip)
    collapsed = 0
    for start, end in large_anonymous_mappings(min_bytes):
        first, last = _whole_huge_pages(start, end)  # whole 2 MB pages inside the mapping only
        for lo, hi in _minus(first, last, holes):
            if madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
                collapsed += hi - lo
    return collapsed


def _minus(first: int, last: int, holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The non-empty parts of [first, last) outside every [lo, hi) of ``holes`` (sorted)."""
    parts = []
    for lo, hi in holes:
        if hi <= lo or hi <= first or lo >= last:
            continue
        if lo > first:
            parts.append((first, lo))
        first = max(first, hi)
    if last > first:
        parts.append((first, last))
    return parts


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros that costs no time now: its own private anonymous mapping (the
    kernel's zero pages, faulted in as they are first written), starting on a 2 MB boundary and
    advised onto 2 MB pages. The tensor holds the only reference to the mapping, which is
    unmapped when the tensor (and every view of it) is gone."""
    nbytes = dtype.itemsize
    for size in shape:
        nbytes *= size
    # One huge page more than asked, so that a 2 MB-aligned start lies inside the mapping (the
    # slack is never touched, so never resident).
    mapping = mmap.mmap(-1, max(nbytes, 1) + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps ``mapping`` alive
    del mapping
    start = -whole.data_ptr() % HUGE_PAGE
    tensor = whole[start:start + nbytes].view(dtype).view(shape)
    advise_huge_pages(tensor.data_ptr(), nbytes)
    return tensor


def copies_in_one_arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the CPU ``tensors``, one after another (each start 64-byte aligned) in one
    ``zeroed_tensor``: the process's own memory, on 2 MB pages where the system has them, written
    once here. For weights read from a file mapping (4 KB page-cache pages) that every decode step
    streams."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.nbytes // 64) * 64
    arena = zeroed_tensor((end,), torch.uint8)
    copies = []
    for t, start in zip(tensors, offsets):
        copy = arena[start:start + t.nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies
