"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, served by the chat endpoint.

An Anthropic request becomes a chat request (``chat_request_of``) that
``OpenAIServingChat`` serves like any other: the same chat template,
tokenization, bounds, sampling, tool calls (parsed, or constrained by
structured outputs), engine call and errors; its answer, JSON or a stream,
becomes Anthropic's in ``frontend.serving.anthropic_replies``. There is no
second generation path. count_tokens renders the prompt the chat endpoint
would render for the same request and counts its tokens.

How the request maps (``chat_prompt``):

- ``system`` -> a system message; text blocks -> text parts (joined as the chat
  endpoint joins them); ``tool_use`` blocks -> the assistant's ``tool_calls``;
  ``tool_result`` blocks -> ``tool`` messages, in order (``is_error``: the
  result reads "Error: ..."), so the template sees what an OpenAI client sends.
- A last turn of the assistant is continued (``continue_final_message``): the
  reply carries on from it, as Anthropic's prefill.
- ``tool_choice`` auto / any / tool / none -> auto / required / the named
  function / none; ``disable_parallel_tool_use`` -> at most one call (any: the
  constraint allows one; auto: calls after the first are dropped).
- ``stop_sequences`` -> ``stop``; ``max_tokens``, ``temperature``, ``top_p``,
  ``top_k`` as they are; ``metadata.user_id`` is accepted without effect.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from backend.types.errors import InvalidRequestError
from frontend import protocol as P
from frontend.protocol import anthropic as A
from frontend.serving import sse
from frontend.serving.anthropic_replies import MessageStream, message_of_chat
from frontend.serving.base import OpenAIServing, ServingContext
from frontend.serving.chat import OpenAIServingChat
from frontend.tool_calls import check_tools, messages_for_template, template_supports_tools

_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}  # "tool": the named function


@dataclass
class ChatPrompt:
    """What renders the chat prompt, in the chat endpoint's terms."""

    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]]
    tool_choice: Union[str, dict[str, Any], None]
    parallel_tool_calls: bool
    continue_final_message: bool  # the last turn is the assistant's: the reply continues it

    @property
    def add_generation_prompt(self) -> bool:
        return not self.continue_final_message


def _text_parts(blocks: list[A.TextBlock]) -> list[dict[str, str]]:
    return [{"type": "text", "text": block.text} for block in blocks]


def _tool_result_text(block: A.ToolResultBlock) -> str:
    text = block.content if isinstance(block.content, str) else "\n".join(part.text for part in block.content)
    return f"Error: {text}" if block.is_error else text


def _chat_messages(message: A.AnthropicMessage, position: int) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: tool results become ``tool`` messages of their own."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, A.TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, A.ToolUseBlock):
            if message.role != "assistant":
                raise InvalidRequestError(f"messages[{position}]: tool_use blocks belong in assistant turns.",
                                          param="messages")
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            if message.role != "user":
                raise InvalidRequestError(f"messages[{position}]: tool_result blocks belong in user turns.",
                                          param="messages")
            if texts:  # text before a result stays before it
                out.append({"role": "user", "content": texts})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _tool_result_text(block)})
    if message.role == "assistant":
        out.append({"role": "assistant", "content": texts, **({"tool_calls": calls} if calls else {})})
    elif texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def chat_prompt(request: A.AnthropicPromptFields) -> ChatPrompt:
    """The request's prompt in the chat endpoint's terms (messages, tools, tool_choice)."""
    messages: list[dict[str, Any]] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else _text_parts(request.system)
        messages.append({"role": "system", "content": system})
    for position, message in enumerate(request.messages):
        messages.extend(_chat_messages(message, position))
    tools = None
    if request.tools:
        tools = [{"type": "function", "function": {
            "name": tool.name, **({"description": tool.description} if tool.description is not None else {}),
            "parameters": tool.input_schema}} for tool in request.tools]  # OpenAI's order: the fallback lists them as JSON
    choice = request.tool_choice
    tool_choice: Union[str, dict[str, Any], None] = None
    if choice is not None:
        if choice.type != "none" and not tools:
            raise InvalidRequestError(f"tool_choice of type {choice.type!r} needs tools.", param="tool_choice")
        if choice.type == "tool":
            if not choice.name:
                raise InvalidRequestError("tool_choice of type 'tool' needs the tool's name.", param="tool_choice")
            tool_choice = {"type": "function", "function": {"name": choice.name}}
        elif choice.name is not None:
            raise InvalidRequestError("tool_choice.name is only for tool_choice of type 'tool'.",
                                      param="tool_choice")
        else:
            tool_choice = _TOOL_CHOICE[choice.type]
    return ChatPrompt(messages, tools, tool_choice,
                      parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
                      continue_final_message=request.messages[-1].role == "assistant")


def chat_request_of(request: A.AnthropicMessagesRequest, request_id: str) -> P.ChatCompletionRequest:
    """The chat request that serves ``request``. A stream carries usage in every chunk: the
    Anthropic stream reports input tokens at its start and the counts at its end."""
    prompt = chat_prompt(request)
    fields: dict[str, Any] = dict(
        model=request.model, messages=prompt.messages, tools=prompt.tools, tool_choice=prompt.tool_choice,
        parallel_tool_calls=prompt.parallel_tool_calls, add_generation_prompt=prompt.add_generation_prompt,
        continue_final_message=prompt.continue_final_message, max_tokens=request.max_tokens,
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, stop=request.stop_sequences,
        stream=request.stream, request_id=request_id)
    if request.stream:
        fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return P.ChatCompletionRequest(**fields)


class AnthropicServingMessages(OpenAIServing):
    """/v1/messages over the chat endpoint, and /v1/messages/count_tokens."""

    def __init__(self, context: ServingContext, chat: OpenAIServingChat) -> None:
        super().__init__(context)
        self.chat = chat

    async def create_message(self, request: A.AnthropicMessagesRequest, raw_request: Request) -> Response:
        message_id = f"msg_{uuid.uuid4().hex}"
        stop_sequences = request.stop_sequences or []
        single_tool_use = request.tool_choice is not None and request.tool_choice.disable_parallel_tool_use
        # cache_read_input_tokens is part of Anthropic's usage: reported whatever the server's flag.
        response = await self.chat.create_chat_completion(chat_request_of(request, message_id), raw_request,
                                                          prompt_tokens_details=True)
        if isinstance(response, StreamingResponse):
            stream = MessageStream(message_id, self.model_name, stop_sequences, single_tool_use)
            return sse.SSEResponse(stream.events(response.body_iterator))
        return self._json(message_of_chat(json.loads(response.body), message_id, self.model_name, stop_sequences,
                                          single_tool_use))

    async def count_tokens(self, request: A.AnthropicCountTokensRequest) -> A.AnthropicCountTokensResponse:
        """The prompt's tokens, rendered as the chat endpoint renders them for the same request."""
        self._check_model(request.model)
        prompt = chat_prompt(request)
        check_tools(prompt.tools, prompt.tool_choice)
        supports_tools = template_supports_tools(self.tokenizer.chat_template)
        messages = messages_for_template(prompt.messages, prompt.tools, supports_tools)
        _, token_ids = await self.renderer.render_and_encode_chat(
            messages, prompt.add_generation_prompt, None, prompt.continue_final_message,
            {"tools": prompt.tools if supports_tools else None}, add_special_tokens=False)
        return A.AnthropicCountTokensResponse(input_tokens=len(token_ids))
