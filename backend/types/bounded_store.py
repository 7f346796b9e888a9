"""A key-value store in memory, bounded by entry count, by bytes and by age: least recently used out
first, and anything older than the age bound gone.

Torch-free, shared by both processes: the backend keeps the Responses API's stored responses in one
(``backend/server/servicer.py``: any frontend can continue a response another one served), and a
frontend with no backend behind it (in-process engine clients, tests) keeps them in its own.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Generic, Optional, TypeVar

V = TypeVar("V")


class BoundedStore(Generic[V]):
    """Values by key, each with its size in bytes; putting one evicts the least recently used
    (``get`` and ``put`` count as uses) while ``max_entries`` or ``max_bytes`` would be exceeded.
    A value larger than ``max_bytes`` alone is not stored. With ``max_age_s``, a value is gone
    that many seconds (of ``clock``) after it was put, however recently it was used."""

    def __init__(self, max_entries: int, max_bytes: int, max_age_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1 or max_bytes < 1 or (max_age_s is not None and max_age_s <= 0):
            raise ValueError("a bounded store holds at least one entry of at least one byte, for some time")
        self.max_entries, self.max_bytes, self.max_age_s = max_entries, max_bytes, max_age_s
        self.clock = clock
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()  # least recently used first
        self._put_times: OrderedDict[str, float] = OrderedDict()  # oldest first
        self.num_bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, key: str, value: V, size_bytes: int) -> bool:
        """Store ``value`` under ``key`` (replacing one); False, storing nothing and keeping any
        older value, if ``size_bytes`` alone exceeds ``max_bytes``."""
        if size_bytes > self.max_bytes:
            return False
        self.delete(key)  # expires the old ones too
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.num_bytes + size_bytes > self.max_bytes):
            self._remove(next(iter(self._entries)))
        self._entries[key] = (value, size_bytes)
        self._put_times[key] = self.clock()
        self.num_bytes += size_bytes
        return True

    def get(self, key: str) -> Optional[V]:
        self._expire()
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def delete(self, key: str) -> bool:
        self._expire()
        if key not in self._entries:
            return False
        self._remove(key)
        return True

    def _remove(self, key: str) -> None:
        _, size_bytes = self._entries.pop(key)
        del self._put_times[key]
        self.num_bytes -= size_bytes

    def _expire(self) -> None:
        if self.max_age_s is None:
            return
        oldest_kept = self.clock() - self.max_age_s
        while self._put_times:
            key, put_time = next(iter(self._put_times.items()))
            if put_time > oldest_kept:
                return
            self._remove(key)
