"""/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): the request and response bodies.

Declared here is exactly what Tandem implements (``frontend.serving.anthropic``
translates it into a chat request): text, ``tool_use`` and ``tool_result``
content blocks, function tools, ``tool_choice``, the sampling fields and
``metadata.user_id``. ``cache_control`` (type ``ephemeral``) is accepted where
Anthropic allows it: the engine's prefix cache already keeps every prompt's
prefix, marked or not, and usage reports what it served. Anything else is
refused with a 400 naming it: the known Anthropic fields Tandem lacks in words
of their own (``UNSUPPORTED_MESSAGES_FIELDS``, other content block types,
server tools), any other field as unknown.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from frontend.protocol.common import RequestModel, ResponseModel

# Known Anthropic request fields Tandem does not implement: a 400 names them when set (to anything
# but null). The value says why, in the error message.
UNSUPPORTED_MESSAGES_FIELDS = {
    "thinking": "extended thinking is not supported by this server",
    "output_config": "output_config (structured outputs) is not supported on /v1/messages; "
                     "use /v1/chat/completions with response_format",
    "output_format": "output_format (structured outputs) is not supported on /v1/messages; "
                     "use /v1/chat/completions with response_format",
    "container": "containers (code execution) are not supported",
    "mcp_servers": "MCP servers are not supported",
    "context_management": "context management is not supported",
    "service_tier": "service tiers are not supported",
    "speed": "speed modes are not supported",
    "inference_geo": "inference_geo is not supported",
}
# Content block types a message may hold; any other (image, document, thinking, ...) is refused.
SUPPORTED_BLOCK_TYPES = ("text", "tool_use", "tool_result")
MAX_TOOL_NAME_LENGTH = 128  # Anthropic's bound on a tool's name
MAX_USER_ID_LENGTH = 256  # Anthropic's bound on metadata.user_id


def _refuse(field: str, reason: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", "{field}: {reason}; leave it out.", {"field": field, "reason": reason})


class CacheControl(RequestModel):
    """Anthropic's prompt-cache marker. Only ``ephemeral`` without a ``ttl``: the prefix cache keeps
    blocks while memory allows, so no lifetime can be promised."""

    type: Literal["ephemeral"]


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None


class ToolUseBlock(RequestModel):
    """A tool call of an earlier assistant turn."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_LENGTH)
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolResultBlock(RequestModel):
    """A tool's answer, in a user turn; ``is_error`` marks it as a failure to the model."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Union[str, list[TextBlock]] = ""
    is_error: bool = False
    cache_control: Optional[CacheControl] = None


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]

    @model_validator(mode="before")
    @classmethod
    def _known_block_types(cls, data: Any) -> Any:
        # Before the union's own error ("does not match any of the expected tags"): say what is refused.
        content = data.get("content") if isinstance(data, dict) else None
        for block in content if isinstance(content, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in SUPPORTED_BLOCK_TYPES:
                raise PydanticCustomError(
                    "unsupported", "content blocks of type '{kind}' are not supported by this server (only "
                    "text, tool_use and tool_result)", {"kind": kind[:40]})
        return data


class AnthropicTool(RequestModel):
    """A client tool (a function the client runs); Anthropic's server tools are refused."""

    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_LENGTH)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[CacheControl] = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise PydanticCustomError("input_schema", "input_schema must be a JSON Schema of type 'object'")
        return schema

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise PydanticCustomError("unsupported", "server tools (type '{kind}') are not supported by this "
                                      "server; give client tools (name, description, input_schema)",
                                      {"kind": kind[:40]})
        return data


class AnthropicToolChoice(RequestModel):
    """auto (the model decides), any (some tool must be called), tool (``name`` must be called),
    none (no tool is called). ``disable_parallel_tool_use``: at most one call."""

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: bool = False


class AnthropicMetadata(RequestModel):
    """Accepted without effect, as OpenAI's ``user``: for the client's own bookkeeping."""

    user_id: Optional[str] = Field(default=None, max_length=MAX_USER_ID_LENGTH)


class AnthropicPromptFields(RequestModel):
    """What renders the prompt: both /v1/messages and count_tokens take these."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    cache_control: Optional[CacheControl] = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, reason in UNSUPPORTED_MESSAGES_FIELDS.items():
                value = data.get(name)
                if value is not None and not (name == "thinking" and value == {"type": "disabled"}):
                    raise _refuse(name, reason)
        return data


class AnthropicMessagesRequest(AnthropicPromptFields):
    max_tokens: int = Field(ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=1)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=1, le=2**31 - 1)
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    metadata: Optional[AnthropicMetadata] = None


class AnthropicCountTokensRequest(AnthropicPromptFields):
    pass


# ---- responses ----------------------------------------------------------------------------------


class ResponseTextBlock(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ResponseToolUseBlock(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(ResponseModel):
    """Anthropic's accounting: the prompt is ``input_tokens`` + ``cache_read_input_tokens`` (the
    part the prefix cache served) + ``cache_creation_input_tokens`` (always 0: caching costs nothing)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class AnthropicMessagesResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Union[ResponseTextBlock, ResponseToolUseBlock]]
    # end_turn | max_tokens | stop_sequence | tool_use
    stop_reason: Optional[str] = None
    stop_sequence: Optional[str] = None
    usage: AnthropicUsage


class AnthropicCountTokensResponse(ResponseModel):
    input_tokens: int


class AnthropicErrorInfo(ResponseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_error, api_error, ...
    message: str


class AnthropicErrorResponse(ResponseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
