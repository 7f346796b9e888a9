"""A key-value store in memory, bounded by entry count and by bytes: least recently used out first.

Torch-free, shared by both processes: the backend keeps the Responses API's stored responses in one
(``backend/server/servicer.py``: any frontend can continue a response another one served), and a
frontend with no backend behind it (in-process engine clients, tests) keeps them in its own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Optional, TypeVar

V = TypeVar("V")


class BoundedStore(Generic[V]):
    """Values by key, each with its size in bytes; putting one evicts the least recently used
    (``get`` and ``put`` count as uses) while ``max_entries`` or ``max_bytes`` would be exceeded.
    A value larger than ``max_bytes`` alone is not stored."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a bounded store holds at least one entry of at least one byte")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, value: V, size_bytes: int) -> bool:
        """Store ``value`` under ``key`` (replacing one); False, storing nothing and keeping any
        older value, if ``size_bytes`` alone exceeds ``max_bytes``."""
        if size_bytes > self.max_bytes:
            return False
        self.delete(key)
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.num_bytes + size_bytes > self.max_bytes):
            _, (_, evicted_size) = self._entries.popitem(last=False)
            self.num_bytes -= evicted_size
        self._entries[key] = (value, size_bytes)
        self.num_bytes += size_bytes
        return True

    def get(self, key: str) -> Optional[V]:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def delete(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.num_bytes -= entry[1]
        return True
