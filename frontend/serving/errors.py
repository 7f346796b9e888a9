"""Errors -> HTTP status and OpenAI error JSON: the one place.

Every error the frontend answers with passes here: typed exceptions raised while
serving (``error_of_exception``), the app's exception handlers
(``install_error_handlers``: validation errors, unknown routes, anything
unexpected), the middlewares (``frontend.middleware``) and the bound on a
request's head below ASGI (``frontend.http_protocol``) build their bodies with
``error_body``. Nothing else in this package, so the middlewares can use it
without loading the engine-call machinery.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backend.types.errors import (EngineDeadError, InvalidRequestError, ModelNotFoundError, OverloadedError,
                                  RequestFailedError, RequestTimeoutError, TandemError)
from frontend import protocol as P

logger = logging.getLogger(__name__)


class AuthenticationError(TandemError):
    """The request lacks the API key or carries a wrong one (HTTP 401)."""


class ClientDisconnectedError(TandemError):
    """The HTTP client went away before the answer was ready; nobody reads the response."""


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than --max-request-body-bytes (HTTP 413)."""


class NotFoundError(InvalidRequestError):
    """What the request names (e.g. a stored response's ID) does not exist here (HTTP 404)."""


HTTP_STATUS_CLIENT_CLOSED_REQUEST = 499  # nginx's: the client went away before the answer


_STATUS_OF_ERROR: tuple[tuple[type[Exception], HTTPStatus], ...] = (
    (RequestTooLargeError, HTTPStatus.REQUEST_ENTITY_TOO_LARGE),  # before its base class
    (NotFoundError, HTTPStatus.NOT_FOUND),  # before its base class
    (InvalidRequestError, HTTPStatus.BAD_REQUEST),
    (AuthenticationError, HTTPStatus.UNAUTHORIZED),
    (ModelNotFoundError, HTTPStatus.NOT_FOUND),
    (OverloadedError, HTTPStatus.TOO_MANY_REQUESTS),  # BackendOverloadedError included; sent with Retry-After
    (EngineDeadError, HTTPStatus.SERVICE_UNAVAILABLE),  # BackendUnavailableError included
    (RequestTimeoutError, HTTPStatus.GATEWAY_TIMEOUT),
    (RequestFailedError, HTTPStatus.INTERNAL_SERVER_ERROR),  # one request failed in the engine; it goes on
)

# vLLM's error ``type`` names (OpenAI's client maps by status code, not by these).
_ERROR_TYPE_OF_STATUS = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.TOO_MANY_REQUESTS: "RateLimitError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: Optional[str] = None) -> P.ErrorResponse:
    status = HTTPStatus(status)
    error_type = _ERROR_TYPE_OF_STATUS.get(status, status.phrase.replace(" ", "") + "Error")
    return P.ErrorResponse(error=P.ErrorInfo(message=_encodable(message), type=error_type,
                                             param=None if param is None else _encodable(param), code=status.value))


def _encodable(text: str) -> str:
    """``text`` with any lone surrogate (an error quoting a client's JSON key) as a ``\\udxxx``
    escape: the error itself must always be writable as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if not text.isascii() else text


def error_of_exception(error: Exception) -> tuple[int, P.ErrorResponse]:
    """The HTTP status and OpenAI error body for an exception; unknown ones are a 500."""
    for error_class, status in _STATUS_OF_ERROR:
        if isinstance(error, error_class):
            return status, error_body(status, str(error), getattr(error, "param", None))
    logger.error("Unexpected error while serving a request", exc_info=error)
    return HTTPStatus.INTERNAL_SERVER_ERROR, error_body(
        HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal server error: {type(error).__name__}: {error}")


def error_json_response(status: int, body: P.ErrorResponse, retry_after_s: Optional[int] = None) -> JSONResponse:
    """The error as a response; a 429 carries ``Retry-After: retry_after_s``."""
    headers = {"Retry-After": str(retry_after_s)} if status == HTTPStatus.TOO_MANY_REQUESTS and retry_after_s else None
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


# ---- the app's exception handlers (every error leaves as OpenAI error JSON) ----------------------


def _validation_message(errors: list[dict]) -> tuple[str, Optional[str]]:
    """Pydantic errors as one message (``field: problem [type=kind]; ...``, the kind as pydantic
    names it, which vLLM's messages carry too) and the first field's name."""
    parts, param = [], None
    for error in errors:
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        if param is None and location:
            param = location[0]
        kind = f" [type={error['type']}]" if error.get("type") else ""
        parts.append(f"{'.'.join(location) or 'body'}: {error.get('msg', 'invalid')}{kind}")
    return "; ".join(parts) or "Invalid request.", param


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Answer every exception a route raises as OpenAI error JSON; a 429 carries ``Retry-After``."""

    async def on_validation_error(request: Request, error: Exception) -> JSONResponse:
        message, param = _validation_message(error.errors())
        return error_json_response(400, error_body(400, message, param))

    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        response = error_json_response(error.status_code, error_body(error.status_code, str(error.detail)))
        response.headers.update(error.headers or {})
        if error.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
            # RFC 9110: Allow lists every method the path takes; Starlette names only the first
            # matching route's (GET and DELETE /v1/responses/{id} are two routes).
            methods = {method for route in request.app.routes if isinstance(route, Route)
                       and route.path_regex.match(request.url.path) for method in route.methods or ()}
            response.headers["Allow"] = ", ".join(sorted(methods))
        return response

    async def on_client_gone(request: Request, error: ClientDisconnectedError) -> Response:
        return Response(status_code=HTTP_STATUS_CLIENT_CLOSED_REQUEST)

    async def on_error(request: Request, error: Exception) -> JSONResponse:
        status, body = error_of_exception(error)
        return error_json_response(status, body, retry_after_s)

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnectedError, on_client_gone)
    app.add_exception_handler(TandemError, on_error)
    app.add_exception_handler(Exception, on_error)  # anything unexpected: a 500, still OpenAI-shaped
