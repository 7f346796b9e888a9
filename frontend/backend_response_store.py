"""Stored /v1/responses responses kept by the backends behind a ``Router``, so that every frontend
behind a load balancer can continue, return or delete a response any of them served.

A response is put on one backend (the router's choice, keyed by the response's ID; on failure the next),
and looked up or deleted on every backend the router could send a request to, concurrently: the
first that holds it answers. Nothing is shared between backends; a backend that restarts loses
what it held (a continuation then gets a 404 naming the ID).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from backend.types.errors import TandemError
from frontend.router import NoBackendError, Router
from frontend.serving.response_store import StoredResponse

logger = logging.getLogger(__name__)


class BackendResponseStore:
    """``frontend.serving.response_store.ResponseStore`` on the router's backends."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def put(self, response_id: str, entry: StoredResponse) -> bool:
        payload = entry.encode()
        tried: set[str] = set()
        while True:
            try:
                # The ID as the routing key: stored responses spread over the backends (the prefix
                # policy would send every empty prompt to the same one).
                backend, _ = self.router.choose([], salt=response_id, exclude=frozenset(tried))
            except NoBackendError:
                return False
            try:
                return await backend.client.put_stored_response(response_id, payload)
            except TandemError as error:
                logger.warning("Storing response %s on %s failed (%s); trying another backend.",
                               response_id, backend.address, error)
                tried.add(backend.address)

    async def get(self, response_id: str) -> Optional[StoredResponse]:
        payloads, error = await self._ask_all("get_stored_response", response_id)
        for payload in payloads:
            if payload is not None:
                return StoredResponse.decode(payload)
        if error is not None:  # the backend that failed may hold it: not a 404
            raise error
        return None

    async def delete(self, response_id: str) -> bool:
        deleted, error = await self._ask_all("delete_stored_response", response_id)
        if not any(deleted) and error is not None:
            raise error
        return any(deleted)

    async def _ask_all(self, method: str, response_id: str) -> tuple[list, Optional[BaseException]]:
        """(the answers of the backends that answered, the last error of one that did not), asking
        every backend a request could be sent to, concurrently."""
        backends = [b for b in self.router.backends.values()
                    if (b.usable or b.admitted) and b.refused is None and not b.retired]
        if not backends:
            raise NoBackendError("No backend can be asked for the stored response now.")
        answers = await asyncio.gather(*(getattr(b.client, method)(response_id) for b in backends),
                                       return_exceptions=True)
        error = None
        for backend, answer in zip(backends, answers):
            if isinstance(answer, BaseException):
                logger.warning("Asking %s about stored response %s failed: %s", backend.address, response_id,
                               answer)
                error = answer
        return [a for a in answers if not isinstance(a, BaseException)], error
