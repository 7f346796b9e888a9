"""The weights of a CPU model on 2 MB pages (Linux transparent huge pages), once they are loaded.

A batch-1 decode step streams every weight once. On 4 KB pages each page is a TLB miss and the
hardware prefetchers stop at each page's end; on 2 MB pages the 2-core CPU's batch-1 step took
19.5-20.0 ms instead of 22.1-22.4 (w8a8) and 51-53 ms instead of 59-64 (fp32). oneDNN's packed
weights are opaque tensors (no data pointer), so instead of placing tensors this collapses the
process's large anonymous mappings, where the weights live, with ``MADV_COLLAPSE`` (Linux 6.1+):
what is populated now moves, later faults keep 4 KB pages (so memory that grows under traffic
grows as before). Elsewhere (THP ``never``, older kernels, not Linux) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

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


def collapse_large_mappings(min_bytes: int = 4 << 20) -> int:
    """Move the populated parts of every large anonymous mapping onto 2 MB pages; returns the bytes
    of the mappings that the kernel collapsed (0 where huge pages are unavailable). Best effort:
    a range the kernel cannot collapse (memory pressure, a page in use elsewhere) stays as it is."""
    if not huge_pages_enabled():
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    collapsed = 0
    for start, end in large_anonymous_mappings(min_bytes):
        first = -(-start // HUGE_PAGE) * HUGE_PAGE  # whole 2 MB pages inside the mapping only
        last = end // HUGE_PAGE * HUGE_PAGE
        if last <= first:
            continue
        if libc.madvise(first, last - first, MADV_COLLAPSE) == 0:
            collapsed += last - first
    return collapsed
