"""The engine's typed errors. Servers map these to status codes in one place each."""

from __future__ import annotations

from typing import Optional


class TandemError(Exception):
    """Base of every error Tandem raises on purpose."""


class InvalidRequestError(TandemError, ValueError):
    """The request cannot be served as asked (gRPC INVALID_ARGUMENT, HTTP 400)."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelNotFoundError(TandemError, ValueError):
    """The model argument names no checkpoint we can find or fetch."""


class EngineDeadError(TandemError, RuntimeError):
    """The engine loop stopped after an internal error (gRPC UNAVAILABLE, HTTP 503)."""


class OverloadedError(TandemError):
    """Admission control refused the request: too many in flight; retry later or elsewhere
    (gRPC RESOURCE_EXHAUSTED, HTTP 429 with Retry-After)."""


class RequestTimeoutError(TandemError):
    """The request did not finish before its deadline (gRPC DEADLINE_EXCEEDED, HTTP 504)."""


class RequestFailedError(TandemError, RuntimeError):
    """One request failed inside the engine (its grammar, sampling, logprobs or drafts raised);
    that request ends, the engine and every other request go on (gRPC INTERNAL, HTTP 500)."""


class WorkerDiedError(EngineDeadError):
    """A worker process (or Ray actor) died or failed: the engine cannot step any more."""
