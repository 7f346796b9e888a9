"""Request and response bodies of the OpenAI-compatible HTTP API (data only, no behaviour).

Field names, types and defaults mirror OpenAI's API plus vLLM's extensions.
Every field a request model declares takes effect, except those in
``UNSUPPORTED_FIELDS``, which are declared (so the schema shows them) and
refused with a 400 naming them when set; an undeclared field is refused too.
``IGNORED_FIELDS`` are the few accepted without effect, as OpenAI metadata.
Value ranges are not checked here: ``SamplingParams`` checks them and names the
parameter, so the HTTP server and the offline ``LLM`` reject the same values
with the same words. Text is: any string in any request field (nested ones,
dict keys included) that is not valid Unicode is refused naming the field.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationInfo, field_validator,
                      model_serializer)

from frontend.unicode_check import check_valid_unicode


def _now() -> int:
    return int(time.time())


class _Request(BaseModel):
    """A request body (or a part of one): unknown fields are refused, and so is text that is not
    valid Unicode, in every field of every request model (``frontend.unicode_check``)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        # A ValueError here becomes a 400 whose param is this field (a nested model's: its parent field).
        field = cls.model_fields.get(info.field_name)
        check_valid_unicode(value, (field.alias if field is not None else None) or info.field_name)
        return value


INT64 = Field(default=None, ge=-2**63, le=2**63 - 1)

# vLLM request fields Tandem does not implement: a 400 names them when they are set
# (to anything but null). The value says why, in the error message.
UNSUPPORTED_FIELDS = {
    "logit_bias": "logit_bias is not supported",
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
}
# Accepted and without effect (OpenAI's end-user ID, for the client's own bookkeeping).
IGNORED_FIELDS = ("user",)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- shared pieces -----------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # the schema is always enforced (strict or not)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(_Request):
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


class Unsupported(_Request):
    """The fields of ``UNSUPPORTED_FIELDS`` (declared for the schema, refused when set)."""

    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    logits_processors: Optional[list[Any]] = None
    priority: Optional[int] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    vllm_xargs: Optional[dict[str, Any]] = None


class SamplingFields(Unsupported):
    """Sampling fields both generation endpoints take; None means the engine default."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
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
    best_of: Optional[int] = None
    length_penalty: float = 1.0
    prompt_logprobs: Optional[int] = None
    logprob_token_ids: Optional[list[int]] = None
    return_token_ids: bool = False  # token IDs of the prompt and of each choice
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>"
    truncate_prompt_tokens: Optional[int] = None  # keep the last k prompt tokens (-1: max_model_len)
    request_id: Optional[str] = None  # the response's ID (and the engine's), instead of a random one
    add_special_tokens: Optional[bool] = None  # None: True for completions, False for chat
    # vLLM's extras.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Prefix-cache isolation: only requests with the same salt share cached prompt blocks.
    cache_salt: Optional[str] = None


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


Logprobs = Optional[list[Optional[dict[int, "PromptLogprob"]]]]


class PromptLogprob(_Response):
    """vLLM's prompt_logprobs entry: a position's token ID -> this."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[int] = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ---- /v1/completions ---------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    # A string, a list of strings, token IDs, or a list of token-ID lists.
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[int] = 16  # OpenAI's and vLLM's default; 0 only with echo (prompt scoring)
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None  # UNSUPPORTED_FIELDS
    prompt_embeds: Optional[Any] = None  # UNSUPPORTED_FIELDS


class CompletionLogProbs(_Response):
    """OpenAI's legacy logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # vLLM's: the stop token ID or string that ended it
    token_ids: Optional[list[int]] = None  # with return_token_ids
    prompt_logprobs: Logprobs = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    service_tier: Optional[str] = None
    system_fingerprint: Optional[str] = None
    usage: UsageInfo
    kv_transfer_params: Optional[dict[str, Any]] = None


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: Optional[UsageInfo] = None


# ---- /v1/chat/completions ----------------------------------------------------------------------


class ChatCompletionRequest(SamplingFields):
    # Passed to the chat template as they are (frontend.tokenizer.render_chat checks them).
    messages: list[dict[str, Any]]
    max_tokens: Optional[int] = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; None: auto with tools
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's: the reply starts with the last message's content, when its role is the reply's
    # vLLM's chat-template extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # UNSUPPORTED_FIELDS
    reasoning_effort: Optional[str] = None
    include_reasoning: Optional[bool] = None
    documents: Optional[list[dict[str, Any]]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Any] = None
    audio: Optional[dict[str, Any]] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None


class FunctionCall(_Response):
    name: Optional[str] = None
    arguments: Optional[str] = None  # JSON text; streamed in pieces

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(_Response):
    """OpenAI's streamed tool call: ``index`` says which; id, type and name come in its first piece."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[FunctionCall] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatMessage(_Response):
    role: str
    content: Optional[str] = None
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = None
    audio: Optional[Any] = None
    function_call: Optional[Any] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: Optional[str] = None


class DeltaMessage(_Response):
    """A streamed piece of the assistant's message; absent fields are left out (``{}`` at the end)."""

    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionTopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatCompletionLogprobContent(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[ChatCompletionTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(_Response):
    content: Optional[list[ChatCompletionLogprobContent]] = None


class ChatCompletionResponseChoice(_Response):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    service_tier: Optional[str] = None
    system_fingerprint: Optional[str] = None
    usage: UsageInfo
    prompt_logprobs: Logprobs = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids
    kv_transfer_params: Optional[dict[str, Any]] = None


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids, in the first chunk


# ---- /v1/models, /tokenize, /detokenize, /version ----------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tandem"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """vLLM's two shapes in one: ``prompt`` (text) or ``messages`` (a chat), not both."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    # None: True for a prompt, False for messages (the chat template adds them), as vLLM.
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    return_token_strs: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class TokenizerInfoResponse(BaseModel):
    """vLLM's /tokenizer_info: the tokenizer's configuration (tokenizer_config.json and a few more)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class LoadResponse(_Response):
    server_load: int  # generation requests this frontend is answering


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[StrictInt]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
