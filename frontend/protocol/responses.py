"""/v1/responses (OpenAI's Responses API): the request, its input items, and the response bodies.

Declared here is exactly what Tandem implements (``frontend.serving.responses``
translates it into a chat request): text input (a string, or message items of
text parts), ``function_call`` and ``function_call_output`` items, function
tools and ``tool_choice``, ``text.format`` (text, json_object, json_schema),
``instructions``, ``max_output_tokens``, ``temperature``, ``top_p``,
``stream``, ``store``, ``previous_response_id``, ``metadata``. ``user`` and
``safety_identifier`` are accepted without effect (the client's bookkeeping).
The output-only fields of items a client sends back from an earlier response
(``id``, ``status``, an output text's ``annotations`` and ``logprobs``, and the
openai SDK's own ``parsed`` / ``parsed_arguments``) are accepted and not used.

Anything else is refused with a 400 naming it: known Responses fields Tandem
lacks (``UNSUPPORTED_RESPONSES_FIELDS``, hidden from the schema; null, and the
value that means "off", are allowed), other item, content and tool types, and
any unknown field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from frontend.protocol.common import RequestModel, ResponseModel

# Known Responses request fields Tandem does not implement -> (why, the values that leave them off).
UNSUPPORTED_RESPONSES_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "reasoning": ("reasoning is not supported by this server", ()),
    "background": ("background responses are not supported", (False,)),
    "include": ("include is not supported (no optional output is filled)", ([],)),
    "truncation": ("truncation 'auto' is not supported; a conversation longer than the context is refused",
                   ("disabled",)),
    "conversation": ("conversations are not supported; use previous_response_id", ()),
    "prompt": ("prompt templates are not supported", ()),
    "max_tool_calls": ("max_tool_calls is not supported", ()),
    "top_logprobs": ("logprobs are not supported on /v1/responses; use /v1/chat/completions", (0,)),
    "service_tier": ("service tiers are not supported", ("auto", "default")),
    "prompt_cache_key": ("prompt_cache_key is not supported (the prefix cache needs no key)", ()),
    "prompt_cache_retention": ("prompt cache retention is not supported", ()),
    "prompt_cache_options": ("prompt cache options are not supported", ()),
    "context_management": ("context management is not supported", ()),
    "moderation": ("moderation is not supported", ()),
    "stream_options": ("stream_options is not supported (no obfuscation is added)", ({"include_obfuscation": False},)),
}
SUPPORTED_ITEM_TYPES = ("message", "function_call", "function_call_output")
SUPPORTED_CONTENT_TYPES = ("input_text", "output_text")
MAX_NAME_LENGTH = 128  # a function's or a schema's name
MAX_ID_LENGTH = 256  # ids a client sends: call_id, item ids, previous_response_id
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds


def _kind(value: Any) -> Optional[str]:
    kind = value.get("type") if isinstance(value, dict) else None
    return kind[:40] if isinstance(kind, str) else None


# ---- input items ---------------------------------------------------------------------------------


class InputText(RequestModel):
    type: Literal["input_text"]
    text: str


class OutputTextPart(RequestModel):
    """An earlier reply's text, sent back; ``annotations`` and ``logprobs`` are output-only."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list, max_length=0)
    logprobs: Optional[list[dict[str, Any]]] = None
    parsed: Optional[Any] = None  # the openai SDK's parse of the text


TextPart = Annotated[Union[InputText, OutputTextPart], Field(discriminator="type")]


def _known_content(content: Any) -> Any:
    for part in content if isinstance(content, list) else ():
        kind = _kind(part)
        if kind is not None and kind not in SUPPORTED_CONTENT_TYPES:
            raise PydanticCustomError("unsupported", "content parts of type '{kind}' are not supported by this "
                                      "server (only input_text and output_text)", {"kind": kind})
    return content


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[TextPart]]
    id: Optional[str] = Field(default=None, max_length=MAX_ID_LENGTH)
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_content(cls, value: Any) -> Any:
        return _known_content(value)


class FunctionCallItem(RequestModel):
    """A function call of an earlier reply."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH)
    arguments: str
    id: Optional[str] = Field(default=None, max_length=MAX_ID_LENGTH)
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    parsed_arguments: Optional[Any] = None  # the openai SDK's parse of the arguments


class FunctionCallOutputItem(RequestModel):
    """The client's result of a function call (``call_id`` names the call)."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    output: Union[str, list[InputText]]
    id: Optional[str] = Field(default=None, max_length=MAX_ID_LENGTH)
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None

    @field_validator("output", mode="before")
    @classmethod
    def _known_content(cls, value: Any) -> Any:
        return _known_content(value)


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")  # a message may leave its type out
    return getattr(value, "type", "message")


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")]],
                      Discriminator(_item_type)]


# ---- tools, tool_choice, text format ---------------------------------------------------------------


class FunctionTool(RequestModel):
    """A function the client runs. ``strict``: the arguments are held to ``parameters`` when the
    call is constrained (tool_choice required or this function); with auto they are parsed."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH)


class TextFormatText(RequestModel):
    type: Literal["text"]


class TextFormatJsonObject(RequestModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(RequestModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH)
    schema_: dict[str, Any] = Field(alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None  # the schema is always enforced

    model_config = {**RequestModel.model_config, "populate_by_name": True}


class TextConfig(RequestModel):
    format: Annotated[Union[TextFormatText, TextFormatJsonObject, TextFormatJsonSchema],
                      Field(discriminator="type")] = Field(default_factory=lambda: TextFormatText(type="text"))
    verbosity: SkipJsonSchema[Optional[Any]] = None

    @field_validator("verbosity", mode="before")
    @classmethod
    def _no_verbosity(cls, value: Any) -> Any:
        if value is not None:
            raise PydanticCustomError("unsupported", "text.verbosity is not supported; leave it out")
        return value


# ---- the request ------------------------------------------------------------------------------------


class ResponsesRequest(RequestModel):
    model: Optional[str] = None
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None  # a system message first; not carried to a continuation
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionToolChoice, None] = None
    parallel_tool_calls: bool = True
    text: Optional[TextConfig] = None
    stream: bool = False
    store: bool = True  # kept in this frontend's memory for previous_response_id and GET
    previous_response_id: Optional[str] = Field(default=None, min_length=1, max_length=MAX_ID_LENGTH)
    metadata: Optional[dict[str, Annotated[str, Field(max_length=MAX_METADATA_VALUE)]]] = Field(
        default=None, max_length=MAX_METADATA_PAIRS)
    user: Optional[str] = None  # accepted without effect
    safety_identifier: Optional[str] = Field(default=None, max_length=64)  # accepted without effect
    # UNSUPPORTED_RESPONSES_FIELDS: hidden from the schema, refused unless null or "off".
    reasoning: SkipJsonSchema[Optional[Any]] = None
    background: SkipJsonSchema[Optional[Any]] = None
    include: SkipJsonSchema[Optional[Any]] = None
    truncation: SkipJsonSchema[Optional[Any]] = None
    conversation: SkipJsonSchema[Optional[Any]] = None
    prompt: SkipJsonSchema[Optional[Any]] = None
    max_tool_calls: SkipJsonSchema[Optional[Any]] = None
    top_logprobs: SkipJsonSchema[Optional[Any]] = None
    service_tier: SkipJsonSchema[Optional[Any]] = None
    prompt_cache_key: SkipJsonSchema[Optional[Any]] = None
    prompt_cache_retention: SkipJsonSchema[Optional[Any]] = None
    prompt_cache_options: SkipJsonSchema[Optional[Any]] = None
    context_management: SkipJsonSchema[Optional[Any]] = None
    moderation: SkipJsonSchema[Optional[Any]] = None
    stream_options: SkipJsonSchema[Optional[Any]] = None

    @field_validator(*UNSUPPORTED_RESPONSES_FIELDS, mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        reason, off = UNSUPPORTED_RESPONSES_FIELDS[info.field_name]
        if value is not None and not any(value == allowed and type(value) is type(allowed) for allowed in off):
            raise PydanticCustomError("unsupported", "{reason}; leave it out", {"reason": reason})
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        # Before the union's own error: say which item type is refused.
        for item in value if isinstance(value, list) else ():
            kind = _kind(item)
            if kind is not None and kind not in SUPPORTED_ITEM_TYPES:
                raise PydanticCustomError("unsupported", "input items of type '{kind}' are not supported by this "
                                          "server (only message, function_call and function_call_output)",
                                          {"kind": kind})
            if isinstance(item, dict):
                _known_content(item.get("content", item.get("output")))
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for tool in value if isinstance(value, list) else ():
            kind = _kind(tool)
            if kind is not None and kind != "function":
                raise PydanticCustomError("unsupported", "tools of type '{kind}' are not supported by this server "
                                          "(only function tools)", {"kind": kind})
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, value: Any) -> Any:
        kind = _kind(value)
        if kind is not None and kind != "function":
            raise PydanticCustomError("unsupported", "tool_choice of type '{kind}' is not supported by this server "
                                      "('none', 'auto', 'required' or a function)", {"kind": kind})
        return value

    @field_validator("metadata")
    @classmethod
    def _short_keys(cls, value: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        if value and max(len(key) for key in value) > MAX_METADATA_KEY:
            raise PydanticCustomError("metadata", "metadata keys are at most {n} characters", {"n": MAX_METADATA_KEY})
        return value


# ---- responses ------------------------------------------------------------------------------------------


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[Union[OutputMessage, OutputFunctionCall], Field(discriminator="type")]


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0  # served by the prefix cache


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(ResponseModel):
    code: str  # server_error | rate_limit_exceeded | invalid_prompt
    message: str


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: Optional[ResponseError] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    store: bool = True
    temperature: Optional[float] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Union[str, dict[str, Any]] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: Optional[float] = None
    truncation: Literal["disabled"] = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
