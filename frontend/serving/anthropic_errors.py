"""Errors on the Anthropic routes: Anthropic's error JSON, with the status ``frontend.serving.errors`` maps.

``frontend.serving.errors`` stays the one place that maps an exception to its
HTTP status (and the message and field it names); this module only reshapes
that answer as ``{"type": "error", "error": {"type": ..., "message": ...}}``.
The routes built with ``anthropic_route_class`` answer this way whatever
fails: request validation (a 400, never a 422), the endpoint's own errors, and
errors in a stream once it began (``stream_error_event``). The edge's
middleware answers its own errors (401, 408, 413, 429) on paths under
``ANTHROPIC_PATH_PREFIX`` in this shape too (``frontend.middleware``).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Callable, Optional

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.protocol.anthropic import AnthropicErrorInfo, AnthropicErrorResponse
from frontend.serving.errors import ClientDisconnectedError, error_of_exception

# Anthropic's error types by status; any other 4xx is invalid_request_error, any other 5xx api_error.
_ERROR_TYPE_OF_STATUS = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.GATEWAY_TIMEOUT: "timeout_error",
}
# The chat request's field names that Anthropic's request spells otherwise (errors raised while
# serving the translated request name the chat field).
_ANTHROPIC_FIELD_OF = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


# The Anthropic routes' common prefix: the edge's middleware answers errors on them in this shape too.
ANTHROPIC_PATH_PREFIX = "/v1/messages"


def error_type_of_status(status: int) -> str:
    if status in _ERROR_TYPE_OF_STATUS:
        return _ERROR_TYPE_OF_STATUS[HTTPStatus(status)]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error(status: int, message: str, param: Optional[str] = None) -> AnthropicErrorResponse:
    """Anthropic's error body. Its errors have no field of their own for the parameter: the message
    names it (in Anthropic's spelling) unless it already does."""
    if param is not None:
        param = _ANTHROPIC_FIELD_OF.get(param, param)
        if param not in message:
            message = f"{param}: {message}"
    return AnthropicErrorResponse(error=AnthropicErrorInfo(type=error_type_of_status(status), message=message))


def validation_message(errors: list[dict]) -> str:
    """Pydantic's errors as one message: ``field.path: problem; ...`` (a problem of the whole body
    without a path; a body that is not JSON says where it breaks)."""
    parts = []
    for error in errors:
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            parts.append(f"The body is not valid JSON ({error.get('msg', 'invalid')} at character "
                         f"{'.'.join(location) or 0}).")
        else:
            parts.append(f"{'.'.join(location)}: {error.get('msg', 'invalid')}" if location
                         else str(error.get("msg", "invalid")))
    return "; ".join(parts) or "Invalid request."


def anthropic_error_of_exception(error: Exception) -> tuple[int, AnthropicErrorResponse]:
    """The status ``frontend.serving.errors`` gives ``error``, and Anthropic's body for it."""
    status, body = error_of_exception(error)
    return status, anthropic_error(status, body.error.message, body.error.param)


def anthropic_error_response(status: int, body: AnthropicErrorResponse,
                             retry_after_s: Optional[int] = None) -> JSONResponse:
    """The error as a response; a 429 carries ``Retry-After: retry_after_s``."""
    headers = {"Retry-After": str(retry_after_s)} if status == HTTPStatus.TOO_MANY_REQUESTS and retry_after_s else None
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


def stream_error_event(openai_error: dict) -> str:
    """The SSE ``error`` event for an error the chat stream reported in OpenAI's shape."""
    status = openai_error.get("code") if isinstance(openai_error.get("code"), int) else 500
    body = anthropic_error(status, str(openai_error.get("message") or "Internal server error"),
                           openai_error.get("param"))
    return f"event: error\ndata: {body.model_dump_json()}\n\n"


def anthropic_route_class(retry_after_s: int) -> type[APIRoute]:
    """A route class whose routes answer every error in Anthropic's shape (FastAPI's custom
    ``APIRoute``: the handler is wrapped, so validation errors are caught too)."""

    class AnthropicRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def answer_errors_as_anthropic(request: Request) -> Response:
                try:
                    return await handler(request)
                except ClientDisconnectedError:
                    raise  # nobody reads the answer: the app's handler ends it with 499
                except StarletteHTTPException as error:  # FastAPI's, e.g. a body that is not UTF-8
                    return anthropic_error_response(error.status_code, anthropic_error(error.status_code,
                                                                                       str(error.detail)))
                except RequestValidationError as error:
                    return anthropic_error_response(400, anthropic_error(400, validation_message(error.errors())))
                except Exception as error:  # noqa: BLE001 -- every error leaves in Anthropic's shape
                    status, body = anthropic_error_of_exception(error)
                    return anthropic_error_response(status, body, retry_after_s)

            return answer_errors_as_anthropic

    return AnthropicRoute
