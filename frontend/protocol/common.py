"""What every endpoint's bodies share: the request and response bases, the sampling fields of the
generation endpoints, usage, prompt logprobs and the error body (``frontend.protocol`` says the rules)."""

from __future__ import annotations

import time
import types
import typing
from typing import Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer,
                      model_validator)
from pydantic.json_schema import SkipJsonSchema

from frontend.unicode_check import check_valid_unicode


def created_now() -> int:
    """A response's ``created``: the Unix time in seconds."""
    return int(time.time())


def _scalar_kind(annotation: Any) -> Optional[str]:
    """"bool" for a field typed bool, "number" for int or float (either optionally None), else None."""
    is_union = typing.get_origin(annotation) in (Union, types.UnionType)
    kinds = {member for member in (typing.get_args(annotation) if is_union else (annotation,))
             if member is not type(None)}
    if kinds == {bool}:
        return "bool"
    return "number" if kinds and kinds <= {int, float} else None


_SCALAR_FIELDS: dict[type, dict[str, str]] = {}


def _scalar_fields(model: type[BaseModel]) -> dict[str, str]:
    """``model``'s bool and number fields: their JSON key (alias or name) -> "bool" or "number"."""
    if model not in _SCALAR_FIELDS:
        kinds = {(field.alias or name): _scalar_kind(field.annotation) for name, field in model.model_fields.items()}
        _SCALAR_FIELDS[model] = {key: kind for key, kind in kinds.items() if kind is not None}
    return _SCALAR_FIELDS[model]


class _WrongJsonType:
    """Stands in for a value of the wrong JSON type, so the field's own validation refuses it
    (and the 400 names the field); pydantic's lax mode would have converted it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


class RequestModel(BaseModel):
    """A request body (or a part of one): unknown fields are refused, and so is text that is not
    valid Unicode, in every field of every request model (``frontend.unicode_check``). Booleans
    and numbers take JSON's types only: pydantic's lax mode would read 0 as false, "1" as 1 and
    true as 1, values /openapi.json calls invalid (5.0 for an integer stays valid, as in JSON Schema)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _json_scalar_types(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        wrong = {}
        for key, kind in _scalar_fields(cls).items():
            value = data.get(key)
            if value is None:
                continue
            if not isinstance(value, bool) if kind == "bool" else isinstance(value, (str, bool)):
                wrong[key] = _WrongJsonType(value)
        return {**data, **wrong} if wrong else data

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        # A ValueError here becomes a 400 whose param is this field (a nested model's: its parent field).
        field = cls.model_fields.get(info.field_name)
        check_valid_unicode(value, (field.alias if field is not None else None) or info.field_name)
        return value


INT64 = Field(default=None, ge=-2**63, le=2**63 - 1)


def ranged(default: Any = None, **bounds: float) -> Any:
    """A field whose /openapi.json schema states the range ``SamplingParams`` (or the endpoint)
    enforces: ``minimum``, ``maximum``, ``exclusiveMinimum`` (JSON Schema's names). Only the schema
    says it here: the check, and its message naming the parameter, stay in one place, shared with
    the offline ``LLM``. Bounds that are settings (``n`` up to ``--max-n``, ...) are added per
    served app by ``frontend.openapi``."""
    return Field(default, json_schema_extra=bounds)

# vLLM request fields Tandem does not implement: a 400 names them when they are set
# (to anything but null). The value says why, in the error message.
UNSUPPORTED_FIELDS = {
    "allowed_token_ids": "allowed_token_ids is not supported",
    "bad_words": "bad_words is not supported",
    "logits_processors": "logits processors are not supported",
    "suffix": "suffix (insertion) is not supported",
    "prompt_embeds": "prompt_embeds are not supported",
    "priority": "priority scheduling is not supported",
    "reasoning_effort": "reasoning is not supported by this server",
    "include_reasoning": "reasoning is not supported by this server",
    "documents": "documents (RAG templates) are not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "kv_transfer_params": "KV transfer is not supported",
    "vllm_xargs": "vllm_xargs are not supported",
    "functions": "functions is deprecated; use tools",
    "function_call": "function_call is deprecated; use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported "
                                 "(structured_outputs.disable_any_whitespace turns JSON whitespace off)",
}
# Accepted and without effect (OpenAI's end-user ID, for the client's own bookkeeping).
IGNORED_FIELDS = ("user",)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- shared pieces -----------------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's: usage in every chunk too, but only with include_usage (alone it changes nothing).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(RequestModel):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # the schema is always enforced (strict or not)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's ``structured_outputs`` (exactly one of json, json_object, regex, choice, grammar)."""

    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Unsupported(RequestModel):
    """The fields of ``UNSUPPORTED_FIELDS``: declared, so a 400 names them when set, and left out
    of /openapi.json (``SkipJsonSchema``), which lists only what takes effect."""

    allowed_token_ids: SkipJsonSchema[Optional[list[int]]] = None
    bad_words: SkipJsonSchema[Optional[list[str]]] = None
    logits_processors: SkipJsonSchema[Optional[list[Any]]] = None
    priority: SkipJsonSchema[Optional[int]] = None  # 0 (the default priority) is accepted
    kv_transfer_params: SkipJsonSchema[Optional[dict[str, Any]]] = None
    vllm_xargs: SkipJsonSchema[Optional[dict[str, Any]]] = None


class LegacyGuidedFields(RequestModel):
    """vLLM's guided decoding fields from before ``structured_outputs`` (vLLM <= 0.10), still sent by
    many clients: accepted as aliases of ``structured_outputs`` (``frontend.serving.guided``), with a
    ``Deprecation`` response header. At most one constraint, and not beside structured_outputs or
    response_format."""

    guided_json: Union[dict[str, Any], str, None] = None  # structured_outputs.json
    guided_regex: Optional[str] = None  # structured_outputs.regex
    guided_choice: Optional[list[str]] = None  # structured_outputs.choice
    guided_grammar: Optional[str] = None  # structured_outputs.grammar
    # "auto" or "xgrammar" (the one backend), optionally with vLLM's options after a colon:
    # "xgrammar:disable-any-whitespace,no-fallback".
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: SkipJsonSchema[Optional[str]] = None  # UNSUPPORTED_FIELDS


class SamplingFields(Unsupported, LegacyGuidedFields):
    """Sampling fields both generation endpoints take; None means the engine default."""

    model: Optional[str] = None
    n: int = ranged(1, minimum=1)  # maximum: --max-n
    temperature: Optional[float] = ranged(minimum=0.0)
    top_p: Optional[float] = ranged(exclusiveMinimum=0.0, maximum=1.0)
    presence_penalty: Optional[float] = ranged(minimum=-2.0, maximum=2.0)
    frequency_penalty: Optional[float] = ranged(minimum=-2.0, maximum=2.0)
    seed: Optional[int] = INT64
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # IGNORED_FIELDS
    # Structured outputs: OpenAI's response_format or vLLM's structured_outputs, not both.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    # Beam search (vLLM's): n beams; best_of: sample best_of and return the n most likely.
    use_beam_search: bool = False
    best_of: Optional[int] = ranged(minimum=1)  # maximum: --max-n
    length_penalty: float = 1.0
    prompt_logprobs: Optional[int] = ranged(minimum=-1)  # -1: the whole vocabulary; maximum: --max-logprobs
    logprob_token_ids: Optional[list[int]] = Field(  # maxItems: --max-logprob-token-ids
        None, json_schema_extra={"minItems": 1, "items": {"type": "integer", "minimum": 0}})
    # Token ID (as a string, OpenAI's form) -> a bias in [-100, 100] added to its logit.
    logit_bias: Optional[dict[str, float]] = Field(  # maxProperties: --max-logit-bias
        None, json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"},
                                 "additionalProperties": {"type": "number", "minimum": -100.0, "maximum": 100.0}})
    return_token_ids: bool = False  # token IDs of the prompt and of each choice
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>"
    truncate_prompt_tokens: Optional[int] = ranged(minimum=-1)  # keep k prompt tokens (-1: max_model_len)
    # vLLM's: which end truncate_prompt_tokens cuts; "left" (None: the same) keeps the last k, "right" the first k.
    truncation_side: Optional[Literal["left", "right"]] = None
    request_id: Optional[str] = None  # the response's ID (and the engine's), instead of a random one
    add_special_tokens: Optional[bool] = None  # None: True for completions, False for chat
    # vLLM's extras.
    top_k: Optional[int] = ranged(minimum=-1)  # -1 and 0: off
    min_p: Optional[float] = ranged(minimum=0.0, maximum=1.0)
    repetition_penalty: Optional[float] = ranged(exclusiveMinimum=0.0)
    min_tokens: int = ranged(0, minimum=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = Field(  # maxItems: --max-stop-sequences
        None, json_schema_extra={"items": {"type": "integer", "minimum": 0}})
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Prefix-cache isolation: only requests with the same salt share cached prompt blocks.
    cache_salt: Optional[str] = None


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    """A reply's token counts; ``prompt_tokens_details`` only with ``--enable-prompt-tokens-details``
    (vLLM's flag), left out (not null) without it."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class PromptLogprob(ResponseModel):
    """vLLM's prompt_logprobs entry: a position's token ID -> this."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's prompt_logprobs: per prompt position (the first is None) token ID -> its logprob.
Logprobs = Optional[list[Optional[dict[int, PromptLogprob]]]]


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[int] = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
