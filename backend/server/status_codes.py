"""Errors -> gRPC status codes, in one place (``map_errors`` wraps every EngineService handler).

A message that does not decode is INVALID_ARGUMENT, never UNKNOWN; an error not listed here is a
bug: it is logged and ends the call INTERNAL.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Awaitable, Callable, Optional

import grpc

from backend.types.errors import (EngineDeadError, InvalidRequestError, OverloadedError, RequestFailedError,
                                  RequestTimeoutError, TandemError)
from backend.types.wire import ERROR_PARAM_METADATA_KEY

logger = logging.getLogger(__name__)


class BackendShuttingDownError(TandemError):
    """The server is draining before it stops; send the request to another backend."""


_STATUS_OF_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (BackendShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (RequestTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (RequestFailedError, grpc.StatusCode.INTERNAL),  # one request failed in the engine; it goes on
)


class UndecodableRequest:
    """What a request deserializer returns for bytes that are not a valid message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


# A servicer method: (servicer, request, context) -> response. The servicer has ``metrics``.
Handler = Callable[[Any, object, grpc.aio.ServicerContext], Awaitable[object]]


def map_errors(handler: Handler) -> Handler:
    """End the call with the status code of the error the handler raised.

    Handlers are coroutines (streams use ``context.write``), so every call ends
    inside the handler and its ``finally`` blocks run at once on cancellation.
    An error not listed in ``_STATUS_OF_ERROR`` is a bug: it is logged and
    ends the call INTERNAL (never UNKNOWN).
    """

    @functools.wraps(handler)
    async def handle(self: Any, request: object, context: grpc.aio.ServicerContext) -> object:
        try:
            if isinstance(request, UndecodableRequest):
                raise InvalidRequestError(f"The request message does not decode: {request.error}")
            return await handler(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:  # noqa: BLE001 -- every error ends the call with a status
            code, message, param = status_of(error, handler.__name__)
            if self.metrics is not None:
                self.metrics.observe_rejected(handler.__name__, code.name.lower())
            await context.abort(code, message,
                                trailing_metadata=((ERROR_PARAM_METADATA_KEY, param),) if param else ())

    return handle


def status_of(error: Exception, method: str) -> tuple[grpc.StatusCode, str, Optional[str]]:
    """The status an error ends a request with: (code, message, the parameter it names or None).

    An error not listed in ``_STATUS_OF_ERROR`` is a bug of ``method``: logged, INTERNAL.
    """
    code = next((code for kind, code in _STATUS_OF_ERROR if isinstance(error, kind)), None)
    if code is None:
        logger.error("%s failed", method, exc_info=error)
        code = grpc.StatusCode.INTERNAL
    return code, str(error) or type(error).__name__, getattr(error, "param", None)


def safe_deserializer(message_class):
    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception as error:  # noqa: BLE001 -- DecodeError and friends: the handler refuses it
            return UndecodableRequest(error)

    return deserialize
