"""The served /openapi.json: FastAPI's schema of the request models, plus what only the served app knows.

The request and response bodies come from the pydantic models that parse them
(``frontend.protocol``), static ranges included (``protocol.common.ranged``).
This module adds, once per app:

* the bounds that are settings (``Limits``: ``n`` up to ``--max-n``, logprobs up to
  ``--max-logprobs``, ...) and the model's context length (max_tokens);
* the error answers the app really gives, in its error shape (OpenAI's, or Anthropic's on
  ``/v1/messages``): 400 for a body or parameter it refuses (never FastAPI's 422: the error
  handlers answer validation errors with 400), 401 without the API key (when one is set), 404
  for an unknown model or ID, 413 for a body past ``--max-request-body-bytes``, 429 when
  admission refuses, 503 when no backend answers.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, TypeAdapter

from backend.types.limits import Limits
from frontend import protocol as P
from frontend.protocol.anthropic import AnthropicErrorResponse

_REF = "#/components/schemas/{model}"
_ANTHROPIC_PREFIX = "/v1/messages"
_ERROR_DESCRIPTIONS = {
    "400": "Invalid request: the error names the parameter (`param`).",
    "401": "Missing or wrong API key.",
    "404": "Unknown model (or ID).",
    "413": "Request body too large.",
    "429": "Too many requests in flight; retry after `Retry-After` seconds.",
    "503": "No backend is serving.",
}


def setting_bounds(limits: Limits, max_model_len: int) -> dict[str, dict[str, int]]:
    """Request property -> the JSON Schema bounds the served app enforces from its settings."""
    logprobs = {"maximum": limits.max_logprobs}
    return {
        "n": {"maximum": limits.max_n},
        "best_of": {"maximum": limits.max_n},
        "logprobs": logprobs,  # completions' count (chat's is a boolean, which maximum leaves alone)
        "top_logprobs": logprobs,
        "prompt_logprobs": logprobs,
        "max_tokens": {"maximum": max_model_len},
        "max_completion_tokens": {"maximum": max_model_len},
        "logit_bias": {"maxProperties": limits.max_logit_bias},
        "logprob_token_ids": {"maxItems": limits.max_logprob_token_ids},
        "stop_token_ids": {"maxItems": limits.max_stop_sequences},
        "cache_salt": {"minLength": 1, "maxLength": limits.max_cache_salt_length},
        "request_id": {"minLength": 1, "maxLength": limits.max_request_id_length},
    }


# The request bodies whose properties take the bounds (the generation endpoints').
_BOUNDED_REQUESTS = ("CompletionRequest", "ChatCompletionRequest")


def install_openapi(app: FastAPI, limits: Limits, max_model_len: int, open_routes: frozenset[str],
                    generation_routes: frozenset[str], api_key_set: bool) -> None:
    """Serve ``app``'s schema with the settings' bounds and the real error answers (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _add_setting_bounds(schema, setting_bounds(limits, max_model_len))
            _document_errors(schema, open_routes, generation_routes, api_key_set)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_setting_bounds(schema: dict[str, Any], bounds: dict[str, dict[str, int]]) -> None:
    components = schema["components"]["schemas"]
    for name in _BOUNDED_REQUESTS:
        properties = components[name]["properties"]
        for prop, extra in bounds.items():
            if prop in properties:
                properties[prop].update(extra)


def _add_component(schema: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    """``model``'s schema (and the models it uses) under components; a ``$ref`` to it."""
    model_schema = TypeAdapter(model).json_schema(ref_template=_REF)
    components = schema["components"]["schemas"]
    components.update(model_schema.pop("$defs", {}))
    components.setdefault(model.__name__, model_schema)
    return {"$ref": _REF.format(model=model.__name__)}


def _document_errors(schema: dict[str, Any], open_routes: frozenset[str], generation_routes: frozenset[str],
                     api_key_set: bool) -> None:
    openai_error = _add_component(schema, P.ErrorResponse)
    anthropic_error = _add_component(schema, AnthropicErrorResponse)
    for path, operations in schema["paths"].items():
        error = anthropic_error if path.startswith(_ANTHROPIC_PREFIX) else openai_error
        for operation in operations.values():
            answers: dict[str, Any] = operation["responses"]
            answers.pop("422", None)  # FastAPI's; the app answers validation errors with 400
            codes = _error_codes(path, operation, open_routes, generation_routes, api_key_set)
            for code in codes:
                answers.setdefault(code, {"description": _ERROR_DESCRIPTIONS[code],
                                          "content": {"application/json": {"schema": error}}})
    components = schema["components"]["schemas"]
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)


def _error_codes(path: str, operation: dict[str, Any], open_routes: frozenset[str],
                 generation_routes: frozenset[str], api_key_set: bool) -> list[str]:
    takes_body = "requestBody" in operation
    codes = []
    if takes_body or operation.get("parameters"):
        codes.append("400")
    if api_key_set and path not in open_routes:
        codes.append("401")
    if takes_body or "{" in path:
        codes.append("404")
    if takes_body:
        codes.append("413")
    if path in generation_routes:
        codes += ["429", "503"]
    return codes


def json_body(*models: type[BaseModel]) -> dict[str, Any]:
    """An ``openapi_extra`` request body of any of ``models`` (their schemas are components)."""
    refs = [{"$ref": _REF.format(model=model.__name__)} for model in models]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": refs}}}}}
