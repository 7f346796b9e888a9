"""How much memory this process can still take on the host: the smaller of the machine's
``MemAvailable`` (/proc/meminfo) and the room left under its cgroup's limit (v2 ``memory.max``
less ``memory.current``; v1 ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``).

The CPU KV cache is a lazily zeroed mapping (backend/models/huge_pages.py): it takes memory as its
pages are first written, so a cache larger than this would start and then be killed under load.
The runner checks it against this figure before allocating, and refuses at start-up instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _read_int(path: str) -> Optional[int]:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """The kernel's estimate of memory available to new allocations, or None where unknown."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_memory_available(meminfo: str = "/proc/meminfo", cgroup_files=_CGROUP_FILES) -> Optional[int]:
    """Bytes this process can still allocate on the host (see the module docstring); None where
    neither figure can be read."""
    candidates = [mem_available_bytes(meminfo)]
    for limit_file, usage_file in cgroup_files:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes a huge number for none
            candidates.append(max(limit - usage, 0))
    known = [c for c in candidates if c is not None]
    return min(known) if known else None
