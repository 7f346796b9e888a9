"""The chat endpoint's answer as Anthropic's: the message JSON, or the stream's events.

``message_of_chat`` turns a chat completion (its JSON) into a Messages
response; ``MessageStream`` turns the chat stream's chunks (OpenAI's SSE) into
Anthropic's events, as they arrive:

    message_start
    content_block_start (text | tool_use), content_block_delta (text_delta |
    input_json_delta) ..., content_block_stop       -- once per block, in order
    message_delta (stop_reason, stop_sequence, usage)
    message_stop

An error in the chat stream becomes an ``error`` event, after which nothing
more is sent. Finish reasons map as: length -> max_tokens; tool calls ->
tool_use; a stop string of ``stop_sequences`` -> stop_sequence (named in
``stop_sequence``); else end_turn. ``single_tool_use``
(``disable_parallel_tool_use``) keeps the first tool call only.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator, Iterator, Optional, Union

from backend.types.errors import RequestFailedError
from frontend.protocol import anthropic as A
from frontend.serving.anthropic_errors import anthropic_error_of_exception, stream_error_event


def anthropic_stop_reason(finish_reason: Optional[str], stop_reason: Union[int, str, None], has_tool_calls: bool,
                          stop_sequences: list[str]) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) for a chat choice's finish_reason and vLLM's stop_reason."""
    if finish_reason == "abort":  # the server ended it (it is draining, or the request's time ran out)
        raise RequestFailedError("The server ended the request before the message was complete.")
    if finish_reason == "length":
        return "max_tokens", None
    if has_tool_calls:
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


def anthropic_usage(usage: dict) -> A.AnthropicUsage:
    """Anthropic's usage for the chat's: prompt tokens the prefix cache served are reported apart."""
    prompt_tokens = usage.get("prompt_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return A.AnthropicUsage(input_tokens=prompt_tokens - cached, output_tokens=usage.get("completion_tokens", 0),
                            cache_read_input_tokens=cached)


def _tool_input(arguments: Optional[str]) -> dict[str, Any]:
    """A finished call's arguments as the tool_use block's input (raises ValueError if they do
    not parse: only a named call cut short by max_tokens has such arguments)."""
    value = json.loads(arguments or "{}")
    if not isinstance(value, dict):
        raise RequestFailedError(f"A tool call's arguments are not a JSON object: {arguments[:80]!r}.")
    return value


def message_of_chat(chat: dict, message_id: str, model: str, stop_sequences: list[str],
                    single_tool_use: bool) -> A.AnthropicMessagesResponse:
    """The Messages response for a chat completion's JSON (its one choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    if single_tool_use:
        calls = calls[:1]
    content: list[Union[A.ResponseTextBlock, A.ResponseToolUseBlock]] = []
    if message.get("content"):
        content.append(A.ResponseTextBlock(text=message["content"]))
    for call in calls:
        arguments = call["function"].get("arguments")
        try:
            tool_input = _tool_input(arguments)
        except json.JSONDecodeError:
            if choice["finish_reason"] != "length":
                raise
            # A named call cut short by max_tokens: its arguments so far, as text (no input to give).
            content.append(A.ResponseTextBlock(text=arguments))
            continue
        content.append(A.ResponseToolUseBlock(id=call["id"], name=call["function"]["name"], input=tool_input))
    stop_reason, stop_sequence = anthropic_stop_reason(choice["finish_reason"], choice.get("stop_reason"),
                                                       bool(calls), stop_sequences)
    return A.AnthropicMessagesResponse(id=message_id, model=model, content=content, stop_reason=stop_reason,
                                       stop_sequence=stop_sequence, usage=anthropic_usage(chat["usage"]))


def _event(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class MessageStream:
    """One streamed message: the chat stream's chunks in, Anthropic's events out (``events``).

    The chat stream must carry usage in its chunks (``stream_options``:
    ``include_usage`` and ``continuous_usage_stats``): the first chunk's gives
    ``message_start`` its input tokens, the last one ``message_delta``'s counts.
    """

    def __init__(self, message_id: str, model: str, stop_sequences: list[str], single_tool_use: bool) -> None:
        self.message_id, self.model = message_id, model
        self.stop_sequences, self.single_tool_use = stop_sequences, single_tool_use
        self._pending = ""  # SSE text of an event not yet whole
        self._usage: dict = {}
        self._started = False
        self._block_index = -1  # the open (or last) content block's index
        self._open_block: Optional[str] = None  # "text" | "tool_use" | None
        self._call_index = -1  # the chat's index of the tool call whose block is open
        self._num_calls = 0
        self._finish: Optional[tuple[str, Union[int, str, None]]] = None
        self._failed = False

    async def events(self, chat_sse: AsyncIterator[Union[str, bytes]]) -> AsyncIterator[str]:
        """Anthropic's events for the chat stream ``chat_sse`` (closed when this ends or is closed,
        which aborts its engine request)."""
        try:
            async with contextlib.aclosing(chat_sse):
                async for piece in chat_sse:
                    for data in self._data_of(piece):
                        if data != "[DONE]":
                            for event in self._translate(json.loads(data)):
                                yield event
            for event in self._end():
                yield event
        except Exception as error:  # noqa: BLE001 -- reported to the client in the stream
            if not self._failed:
                _, body = anthropic_error_of_exception(error)
                yield f"event: error\ndata: {body.model_dump_json()}\n\n"

    def _data_of(self, piece: Union[str, bytes]) -> Iterator[str]:
        """The ``data`` of each whole SSE event the chat stream has sent so far."""
        self._pending += piece.decode() if isinstance(piece, bytes) else piece
        *whole, self._pending = self._pending.split("\n\n")
        for block in whole:
            for line in block.split("\n"):
                if line.startswith("data:"):
                    yield line[6:] if line.startswith("data: ") else line[5:]

    def _translate(self, chunk: dict) -> list[str]:
        if self._failed:
            return []
        if "choices" not in chunk and isinstance(chunk.get("error"), dict):
            self._failed = True
            return [stream_error_event(chunk["error"])]
        events = []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        if not self._started:
            self._started = True
            events.append(_event({"type": "message_start", "message": {
                "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                # Output so far: none (the first chunk's count depends on how far the engine got).
                "usage": anthropic_usage({**self._usage, "completion_tokens": 0}).model_dump(mode="json")}}))
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                events += self._close_block()
                self._finish = (choice["finish_reason"], choice.get("stop_reason"))
        return events

    def _end(self) -> list[str]:
        if self._failed:
            return []
        if self._finish is None:
            raise RequestFailedError("The stream ended before the message was complete.")
        stop_reason, stop_sequence = anthropic_stop_reason(*self._finish, self._num_calls > 0, self.stop_sequences)
        return [_event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": anthropic_usage(self._usage).model_dump(mode="json")}),
                _event({"type": "message_stop"})]

    # ---- content blocks ----

    def _text(self, text: str) -> list[str]:
        events = [] if self._open_block == "text" else self._close_block() + self._start_block(
            {"type": "text", "text": ""})
        events.append(_event({"type": "content_block_delta", "index": self._block_index,
                              "delta": {"type": "text_delta", "text": text}}))
        return events

    def _tool_call(self, call: dict) -> list[str]:
        """One piece of the chat's ``delta.tool_calls``: a call's first piece (its id and name) opens
        its block; its arguments stream as ``input_json_delta``."""
        index = call.get("index", 0)
        if self.single_tool_use and index > 0:
            return []
        function = call.get("function") or {}
        events = []
        if call.get("id"):
            events += self._close_block() + self._start_block(
                {"type": "tool_use", "id": call["id"], "name": function.get("name"), "input": {}})
            self._call_index = index
            self._num_calls += 1
        if function.get("arguments"):
            if self._open_block != "tool_use" or self._call_index != index:
                raise RequestFailedError(f"Tool call {index}'s arguments came before its name.")
            events.append(_event({"type": "content_block_delta", "index": self._block_index,
                                  "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}}))
        return events

    def _start_block(self, block: dict) -> list[str]:
        self._block_index += 1
        self._open_block = block["type"]
        return [_event({"type": "content_block_start", "index": self._block_index, "content_block": block})]

    def _close_block(self) -> list[str]:
        if self._open_block is None:
            return []
        self._open_block = None
        return [_event({"type": "content_block_stop", "index": self._block_index})]
