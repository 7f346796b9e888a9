"""Stored responses of /v1/responses: what ``previous_response_id`` continues, GET returns and
DELETE forgets.

Two stores with one (async) interface, ``ResponseStore``:

- ``LocalResponseStore``: this process's memory. For a frontend over an in-process engine
  (and the tests); behind a load balancer it would tie a conversation to one frontend.
- ``frontend.backend_response_store.BackendResponseStore``: kept by the backends (the
  ``PutStoredResponse`` / ``GetStoredResponse`` / ``DeleteStoredResponse`` RPCs), so any
  frontend continues a response another one served: what ``tandem frontend`` uses.

Both are bounded by count and bytes, least recently used evicted first, and by age (the
backend's by ``--max-stored-responses``, ``--max-stored-response-bytes`` and
``--max-stored-response-age-s``); an entry larger than the byte bound alone is not stored
(``put`` says so).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from pydantic import TypeAdapter

from backend.types.bounded_store import BoundedStore
from backend.types.limits import Limits
from frontend.protocol import responses as R

_CONVERSATION = TypeAdapter(list[R.InputItem])


@dataclass(frozen=True)
class StoredResponse:
    """A response's body (as GET returns it) and its conversation: the input items it was given
    (an earlier response's conversation first) and its output items, as input items."""

    body: dict[str, Any]
    conversation: list[Any]

    def encode(self) -> bytes:
        """JSON bytes (what the stores keep and count)."""
        return json.dumps({"body": self.body, "conversation": [item.model_dump(mode="json", exclude_none=True)
                                                               for item in self.conversation]}).encode()

    @classmethod
    def decode(cls, payload: bytes) -> "StoredResponse":
        data = json.loads(payload)
        return cls(data["body"], _CONVERSATION.validate_python(data["conversation"]))


class ResponseStore(Protocol):
    async def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep ``entry``; False if it was not kept (too large, or no backend took it)."""

    async def get(self, response_id: str) -> Optional[StoredResponse]:
        """The entry, or None if no store holds it."""

    async def delete(self, response_id: str) -> bool:
        """Forget the entry; False if no store held it."""


class LocalResponseStore:
    """``ResponseStore`` in this process's memory (encoded, as the backends keep them)."""

    def __init__(self, max_entries: int = Limits.max_stored_responses,
                 max_bytes: int = Limits.max_stored_response_bytes,
                 max_age_s: float = Limits.max_stored_response_age_s) -> None:
        self.entries: BoundedStore[bytes] = BoundedStore(max_entries, max_bytes, max_age_s)

    async def put(self, response_id: str, entry: StoredResponse) -> bool:
        payload = entry.encode()
        return self.entries.put(response_id, payload, len(payload))

    async def get(self, response_id: str) -> Optional[StoredResponse]:
        payload = self.entries.get(response_id)
        return StoredResponse.decode(payload) if payload is not None else None

    async def delete(self, response_id: str) -> bool:
        return self.entries.delete(response_id)
