"""Reading ``tool_choice="required"``'s reply as it is generated: a JSON array of calls.

Structured outputs hold the reply to ``frontend.tool_calls.constrained_tool_schema``'s
array, ``[{"name": ..., "parameters": {...}}, ...]``, so every prefix of it is a
prefix of valid JSON. ``CallArrayReader`` scans it character by character (each
character once: O(reply) in all) and hands out each call as soon as it can:

- its header (id and name) once the name's string has closed and its
  ``parameters`` value has begun;
- the ``parameters`` text (the call's arguments) as it arrives, when it is an
  object or an array; another JSON value once it is whole;
- a call whose ``parameters`` came before its ``name`` all at once, when its
  object closes.

``complete`` holds the calls whose objects closed (their arguments the text as
generated, as they streamed: a reply whole or streamed gives the same strings),
so a reply cut short by ``max_tokens`` still gives the calls generated before
the cut.
"""

from __future__ import annotations

import json
from typing import Optional

from frontend.tool_calls import ToolCall, ToolCallDelta

_WHITESPACE = " \t\r\n"


class CallArrayReader:
    """One reply's array of calls, pushed in pieces (``push``); see the module's docstring."""

    def __init__(self) -> None:
        self.text = ""
        self.complete: list[ToolCall] = []
        self.num_started = 0  # calls whose header was handed out
        self._position = 0  # the next character to scan
        self._depth = 0  # open containers ({ or [), the array itself included
        self._in_string = False
        self._escaped = False
        self._item = -1  # the index of the array item being read
        self._reset_item()

    def _reset_item(self) -> None:
        # Inside an item's object (depth 2): reading a key, a value, or between them.
        self._expect = "key"  # "key" | "value" | "after"
        self._key_start: Optional[int] = None
        self._key: Optional[str] = None
        self._value_start: Optional[int] = None
        self._name: Optional[str] = None
        self._arguments: Optional[tuple[int, int]] = None  # the parameters' span, once whole
        self._sent_to: Optional[int] = None  # the arguments are handed out up to here
        self._call: Optional[ToolCall] = None  # the call whose header was handed out

    def push(self, delta: str) -> list[ToolCallDelta]:
        """The call pieces ``delta`` completes: (call index, id, name, arguments text), at most one
        per call, the id and name in a call's first."""
        self.text += delta
        pieces: dict[int, ToolCallDelta] = {}
        text = self.text
        while self._position < len(text):
            self._scan(text[self._position], self._position, pieces)
            self._position += 1
        self._stream_arguments(pieces)
        return list(pieces.values())

    # ---- the scan ----

    def _scan(self, char: str, at: int, pieces: dict[int, ToolCallDelta]) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._depth == 2:
                    self._string_closed(at, pieces)
            return
        if char in _WHITESPACE:
            return
        if self._depth == 2 and self._expect == "value" and self._value_start is None:
            self._value_start = at  # any value's first character
        if char == '"':
            self._in_string = True
            if self._depth == 2 and self._expect == "key":
                self._key_start = at
        elif char in "{[":
            self._depth += 1
            if self._depth == 2:  # an item's object opens
                self._item += 1
                self._reset_item()
        elif char in "}]":
            self._depth -= 1
            if self._depth == 2 and self._expect == "value":  # a container value closed
                self._value_closed(at + 1, pieces)
            elif self._depth == 1:  # the item's object closed
                if self._expect == "value" and self._value_start is not None:
                    self._value_closed(at, pieces)  # a number, true, false or null ends here
                self._item_closed(pieces)
        elif self._depth == 2 and char == ":":
            self._expect = "value"
            self._value_start = None
        elif self._depth == 2 and char == ",":
            if self._expect == "value" and self._value_start is not None:
                self._value_closed(at, pieces)
            self._expect = "key"

    def _string_closed(self, at: int, pieces: dict[int, ToolCallDelta]) -> None:
        if self._expect == "key" and self._key_start is not None:
            self._key = json.loads(self.text[self._key_start:at + 1])
            self._key_start = None
        elif self._expect == "value":
            self._value_closed(at + 1, pieces)

    def _value_closed(self, end: int, pieces: dict[int, ToolCallDelta]) -> None:
        start, self._expect = self._value_start, "after"
        if start is None:
            return
        if self._key == "name":
            name = json.loads(self.text[start:end])
            self._name = name if isinstance(name, str) else None
        elif self._key == "parameters":
            self._arguments = (start, end)
        self._stream_arguments(pieces)

    def _item_closed(self, pieces: dict[int, ToolCallDelta]) -> None:
        if self._name is None or self._arguments is None:
            return  # not a call (the schema requires both; without it, nothing is handed out)
        self._stream_arguments(pieces)
        start, end = self._arguments
        self.complete.append(ToolCall(self._name, self.text[start:end], id=self._call.id if self._call else ""))

    # ---- handing out ----

    def _stream_arguments(self, pieces: dict[int, ToolCallDelta]) -> None:
        """Hand out the current call's header and the arguments text that arrived since."""
        if self._name is None or self._depth < 2 and self._arguments is None:
            return
        if self._arguments is not None:
            start, end = self._arguments
        elif self._key == "parameters" and self._expect == "value" and self._value_start is not None \
                and self.text[self._value_start] in "{[":
            start, end = self._value_start, len(self.text)  # an object or array, still open
        else:
            return
        if self._call is None:
            self._call = ToolCall(self._name, "")
            self.num_started += 1
        sent = start if self._sent_to is None else self._sent_to
        header = self._sent_to is None
        self._sent_to = end
        if not header and end <= sent:
            return
        index, call_id, name, before = pieces.get(self._item, (self._item, None, None, ""))
        if header:
            call_id, name = self._call.id, self._call.name
        pieces[self._item] = (index, call_id, name, before + self.text[sent:end])
