"""/v1/chat/completions: the request, the message and tool-call pieces, the response and stream chunks."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, model_serializer
from pydantic.json_schema import SkipJsonSchema

from frontend.protocol.common import Logprobs, ResponseModel, SamplingFields, UsageInfo, created_now, ranged


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0}]})

    # Passed to the chat template as they are (frontend.tokenizer.render_chat checks them).
    messages: list[dict[str, Any]]
    # maximum (both): max_model_len.
    max_tokens: Optional[int] = ranged(minimum=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Optional[int] = ranged(minimum=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = ranged(minimum=-1)  # -1: the whole vocabulary; maximum: --max-logprobs
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
    # UNSUPPORTED_FIELDS: refused when set, so not in the schema.
    reasoning_effort: SkipJsonSchema[Optional[str]] = None
    include_reasoning: SkipJsonSchema[Optional[bool]] = None
    documents: SkipJsonSchema[Optional[list[dict[str, Any]]]] = None
    mm_processor_kwargs: SkipJsonSchema[Optional[dict[str, Any]]] = None
    functions: SkipJsonSchema[Optional[list[dict[str, Any]]]] = None
    function_call: SkipJsonSchema[Optional[Any]] = None
    audio: SkipJsonSchema[Optional[dict[str, Any]]] = None
    modalities: SkipJsonSchema[Optional[list[str]]] = None
    prediction: SkipJsonSchema[Optional[dict[str, Any]]] = None
    web_search_options: SkipJsonSchema[Optional[dict[str, Any]]] = None


class FunctionCall(ResponseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None  # JSON text; streamed in pieces

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ResponseModel):
    """OpenAI's streamed tool call: ``index`` says which; id, type and name come in its first piece."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[FunctionCall] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatMessage(ResponseModel):
    role: str
    content: Optional[str] = None
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = None
    audio: Optional[Any] = None
    function_call: Optional[Any] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: Optional[str] = None


class DeltaMessage(ResponseModel):
    """A streamed piece of the assistant's message; absent fields are left out (``{}`` at the end),
    but a ``content`` given as None is written as null (OpenAI's role chunk of a reply that is only
    tool calls)."""

    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items()
                if value is not None or (key == "content" and key in self.model_fields_set)}


class ChatCompletionTopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatCompletionLogprobContent(ResponseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[ChatCompletionTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    content: Optional[list[ChatCompletionLogprobContent]] = None


class ChatCompletionResponseChoice(ResponseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=created_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    service_tier: Optional[str] = None
    system_fingerprint: Optional[str] = None
    usage: UsageInfo
    prompt_logprobs: Logprobs = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids
    kv_transfer_params: Optional[dict[str, Any]] = None


class ChatCompletionStreamChoice(ResponseModel):
    """A chunk's choice. OpenAI's ``logprobs`` and ``finish_reason`` are always there (null when
    unset); vLLM's ``stop_reason`` only with the finish (null there for EOS or the length), and
    ``token_ids`` only with return_token_ids, as vLLM writes its chunks (its unset keys left out)."""

    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        data = handler(self)
        if data["token_ids"] is None:
            del data["token_ids"]
        if data["finish_reason"] is None and data["stop_reason"] is None:
            del data["stop_reason"]
        return data


class ChatCompletionStreamResponse(ResponseModel):
    """A chunk; ``usage`` (stream_options) and ``prompt_token_ids`` (return_token_ids, the first
    chunk) are left out of the chunks without them, as vLLM leaves them out."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=created_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids, in the first chunk

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {key: value for key, value in handler(self).items()
                if value is not None or key not in ("usage", "prompt_token_ids")}
