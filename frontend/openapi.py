"""The served /openapi.json: FastAPI's schema of the request models, plus what only the served app knows.

The request and response bodies come from the pydantic models that parse them
(``frontend.protocol``), static ranges included (``protocol.common.ranged``).
This module adds, once per app:

* the bounds that are settings (``Limits``: ``n`` up to ``--max-n``, logprobs up to
  ``--max-logprobs``, ...) and the model's (max_tokens up to its context length, token IDs
  below its vocabulary size); prompts are not empty; chat messages have the shape
  ``frontend.tokenizer`` checks (a role of 1 to ``MAX_ROLE_CHARS`` characters, text content);
* the error answers the app really gives, in its error shape (OpenAI's, or Anthropic's on
  ``/v1/messages``): 400 for a body or parameter it refuses (never FastAPI's 422: the error
  handlers answer validation errors with 400), 401 without the API key (when one is set), 404
  for an unknown model or ID, 413 for a body past ``--max-request-body-bytes``, 429 when
  admission refuses, 503 when no backend answers;
* each server-sent event of a streamed answer (OpenAPI 3.1: the media type's schema describes one
  event): its ``data`` is JSON, a chunk of the route's stream model where it has one (or an error
  body), and OpenAI's streams end with ``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, TypeAdapter

from backend.types.limits import Limits
from backend.types.outputs import ModelInfo
from frontend import protocol as P
from frontend.protocol.anthropic import AnthropicErrorResponse
from frontend.tokenizer import MAX_ROLE_CHARS

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


def setting_bounds(limits: Limits, model_info: ModelInfo) -> dict[str, dict[str, Any]]:
    """Request property -> the JSON Schema bounds the served app enforces from its settings."""
    # --max-logprobs -1: the whole vocabulary (which a request asks for with -1, the schemas' minimum).
    logprobs = {"maximum": model_info.vocab_size if limits.max_logprobs == -1 else limits.max_logprobs}
    max_model_len = model_info.max_model_len
    token_id = {"type": "integer", "minimum": 0, "maximum": model_info.vocab_size - 1}
    return {
        "n": {"maximum": limits.max_n},
        "best_of": {"maximum": limits.max_n},
        "logprobs": logprobs,  # completions' count (chat's is a boolean, which maximum leaves alone)
        "top_logprobs": logprobs,
        "prompt_logprobs": logprobs,
        "max_tokens": {"maximum": max_model_len},
        "max_completion_tokens": {"maximum": max_model_len},
        "logit_bias": {"maxProperties": limits.max_logit_bias},
        "logprob_token_ids": {"maxItems": limits.max_logprob_token_ids, "items": token_id},
        "stop_token_ids": {"maxItems": limits.max_stop_sequences, "items": token_id},
        "cache_salt": {"minLength": 1, "maxLength": limits.max_cache_salt_length},
        "request_id": {"minLength": 1, "maxLength": limits.max_request_id_length},
    }


# The request bodies whose properties take the bounds (the generation endpoints').
_BOUNDED_REQUESTS = ("CompletionRequest", "ChatCompletionRequest")


# Request property -> a prompt (not empty) or token IDs (in the vocabulary; /detokenize takes []).
_PROMPTS = {"CompletionRequest": ("prompt", True), "EmbeddingRequest": ("input", True),
            "PoolingRequest": ("input", True), "DetokenizeRequest": ("tokens", False)}


def install_openapi(app: FastAPI, limits: Limits, model_info: ModelInfo, open_routes: frozenset[str],
                    generation_routes: frozenset[str], api_key_set: bool) -> None:
    """Serve ``app``'s schema with the settings' bounds and the real error answers (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _add_setting_bounds(schema, setting_bounds(limits, model_info))
            components = schema["components"]["schemas"]
            for model, (prop, non_empty) in _PROMPTS.items():
                if model in components:
                    _bound_prompt(components[model]["properties"][prop], model_info.vocab_size, non_empty)
            components["ChatCompletionRequest"]["properties"]["messages"].update(CHAT_MESSAGES)
            _document_errors(schema, open_routes, generation_routes, api_key_set)
            _document_streams(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_setting_bounds(schema: dict[str, Any], bounds: dict[str, dict[str, Any]]) -> None:
    components = schema["components"]["schemas"]
    for name in _BOUNDED_REQUESTS:
        properties = components[name]["properties"]
        for prop, extra in bounds.items():
            if prop in properties:
                properties[prop].update(extra)


# What frontend.tokenizer accepts as chat messages (the template may refuse more, e.g. roles out of turn).
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
CHAT_MESSAGES = {"minItems": 1, "items": {
    "type": "object", "required": ["role"],
    "properties": {"role": {"type": "string", "minLength": 1, "maxLength": MAX_ROLE_CHARS},
                   "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART},
                                         {"type": "null"}]}}}}


def _bound_prompt(node: Any, vocab_size: int, non_empty: bool) -> None:
    """Every integer in a prompt's schema a token ID; with ``non_empty``, every string and list not empty."""
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "string" and non_empty:
            node["minLength"] = 1
        elif kind == "array" and non_empty:
            node["minItems"] = 1
        elif kind == "integer":
            node.update(minimum=0, maximum=vocab_size - 1)
        for child in node.values():
            _bound_prompt(child, vocab_size, non_empty)
    elif isinstance(node, list):
        for child in node:
            _bound_prompt(child, vocab_size, non_empty)


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


# Route -> the models of its stream's chunks (an OpenAI stream, ending with [DONE]); other
# streams (Responses', Anthropic's) send one JSON object per named event.
_STREAM_CHUNKS: dict[str, tuple[type[BaseModel], ...]] = {
    "/v1/completions": (P.CompletionStreamResponse,),
    "/v1/chat/completions": (P.ChatCompletionStreamResponse,),
    "/invocations": (P.ChatCompletionStreamResponse, P.CompletionStreamResponse),
}


def _document_streams(schema: dict[str, Any]) -> None:
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            content = operation["responses"].get("200", {}).get("content", {})
            if "text/event-stream" not in content:
                continue
            json_data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json"}
            if path in _STREAM_CHUNKS:
                chunks = [_add_component(schema, model) for model in (*_STREAM_CHUNKS[path], P.ErrorResponse)]
                json_data["contentSchema"] = {"anyOf": chunks}
                data = {"anyOf": [{"const": "[DONE]"}, json_data]}
            else:
                data = json_data
            content["text/event-stream"] = {"schema": {
                "type": "object", "required": ["data"],
                "properties": {"data": data, "event": {"type": "string"}}}}


def json_body(*models: type[BaseModel]) -> dict[str, Any]:
    """An ``openapi_extra`` request body of any of ``models`` (their schemas are components)."""
    refs = [{"$ref": _REF.format(model=model.__name__)} for model in models]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": refs}}}}}
