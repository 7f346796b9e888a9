"""One choice's reply under a ``tool_choice``: its content and tool calls, whole or streamed.

How each mode reads the model's text (``frontend.tool_calls`` says how it is
asked for):

- ``none``: all content.
- ``auto``: parsed in the model's format; streamed, each call once it closes.
- ``named``: the text is the named function's arguments (constrained JSON),
  streamed as it is generated; the call's header comes with its first piece. A
  reply cut short (``max_tokens``) is still the call, with the arguments as far
  as they got (whole or streamed alike; the finish reason says ``length``).
- ``required``: the constrained array of calls, read as it arrives
  (``frontend.tool_call_array``): each call streams as soon as its name is
  known. A reply cut short (``max_tokens``) keeps the calls completed before the
  cut; with none begun, its text is content.

Streamed pieces follow OpenAI's ``delta.tool_calls``: at most one entry per
call index in one chunk (``merge_tool_deltas``), the id and name in a call's
first, so clients that accumulate entries by index (the openai SDK's
``stream()``) rebuild the arguments exactly.
"""

from __future__ import annotations

from typing import Optional

from frontend.tool_call_array import CallArrayReader
from frontend.tool_calls import (StreamingToolCallParser, ToolCall, ToolCallDelta, calls_from_constrained,
                                 parse_tool_calls)


def merge_tool_deltas(pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One piece per call index, in the order the calls first appear: the id and name of the
    first piece that has them, the arguments of all of them joined."""
    merged: dict[int, ToolCallDelta] = {}
    for index, call_id, name, arguments in pieces:
        if index in merged:
            _, first_id, first_name, before = merged[index]
            merged[index] = (index, first_id or call_id, first_name or name, before + arguments)
        else:
            merged[index] = (index, call_id, name, arguments)
    return list(merged.values())


class ToolReply:
    """One choice's reply; ``mode``: "none", "auto" (parsed with ``parser``), "required" or
    "named" (the constrained JSON of ``constrained_tool_schema``)."""

    def __init__(self, mode: str, parser: str, named: Optional[str] = None) -> None:
        self.mode, self.named = mode, named
        self._stream = StreamingToolCallParser(parser) if mode == "auto" else None
        self._array = CallArrayReader() if mode == "required" else None
        self._named_id: Optional[str] = None
        self.num_calls = 0  # calls handed out so far (streamed: begun)

    @property
    def finish_reason_with_calls(self) -> str:
        return "stop" if self.mode == "named" else "tool_calls"  # OpenAI's: a named call "stop"s

    def whole(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content, calls) of a whole reply."""
        if self.mode == "none":
            return text, []
        if self.mode == "auto":
            content, calls = parse_tool_calls(self._stream.parser, text)
            return (content or None) if calls else content, calls
        if self.mode == "required":
            reader = CallArrayReader()
            reader.push(text)
            return (None, reader.complete) if reader.complete else (text, [])
        try:
            return None, calls_from_constrained(text, self.named)
        except ValueError:  # cut short (max_tokens) before the JSON closed: still the named call,
            # its arguments the text as generated (as streamed; vLLM does the same)
            return None, [ToolCall(self.named, text)]

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content, call pieces) that ``text``, the reply's next piece, releases."""
        if self.mode == "none":
            return text, []
        if self.mode == "auto":
            content, calls = self._stream.push(text)
            return content, self._deltas(calls)
        if self.mode == "named":  # the arguments stream as they are generated
            if self._named_id is None:
                self._named_id = ToolCall(self.named, "").id
                self.num_calls = 1
                return "", [(0, self._named_id, self.named, text)]
            return "", [(0, None, None, text)] if text else []
        pieces = self._array.push(text)
        self.num_calls = self._array.num_started
        return "", pieces

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What the end of the reply releases."""
        if self.mode == "auto":
            content, calls = self._stream.finish()
            return content, self._deltas(calls)
        if self.mode == "required" and not self._array.num_started:
            return self._array.text, []  # cut short before any call began: the text as it is
        return "", []

    def _deltas(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        out = []
        for call in calls:
            out.append((self.num_calls, call.id, call.name, call.arguments))
            self.num_calls += 1
        return out
