"""Stored responses of /v1/responses: what ``previous_response_id`` continues and GET returns.

In this frontend process's memory, bounded by count and by bytes; the least
recently used entry goes first when either bound is reached. An entry larger
than the byte bound is not stored (``put`` says so). The frontends are
stateless otherwise: behind a load balancer, a continuation reaches a
frontend that may not hold its response (a 404 that says so); a store shared
by the frontends is future work.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_MAX_STORED_RESPONSES = 1024
DEFAULT_MAX_STORED_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    """A response's body (as GET returns it) and its conversation: the input items it was given
    (an earlier response's conversation first) and its output items, as input items."""

    body: dict[str, Any]
    conversation: list[Any]
    size_bytes: int  # the JSON size of both, what the byte bound counts


class ResponseStore:
    """Responses by ID, least recently used evicted first once ``max_entries`` or ``max_bytes``
    would be exceeded."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_STORED_BYTES) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a response store holds at least one entry of at least one byte")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store ``entry`` (replacing one with its ID); False, storing nothing, if it alone is
        larger than ``max_bytes``."""
        if entry.size_bytes > self.max_bytes:
            return False
        self.delete(response_id)
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.num_bytes + entry.size_bytes > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.size_bytes
        self._entries[response_id] = entry
        self.num_bytes += entry.size_bytes
        return True

    def get(self, response_id: str) -> Optional[StoredResponse]:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.size_bytes
        return True
