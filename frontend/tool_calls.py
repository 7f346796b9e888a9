"""Tool calling on /v1/chat/completions: rendering tools, constraining and parsing tool calls.

Torch-free (frontend). How ``tool_choice`` is served:

- ``none``: tools are rendered, the reply is plain content (never parsed).
- ``auto``: the model decides; its text is parsed by the tool-call parser for the
  model's format, which splits it into content and tool calls (streamed: content
  as it comes, each call once its closing tag arrives).
- ``required`` / a named function: the reply is constrained by structured
  outputs to a JSON array of ``{"name", "parameters"}`` (required: one item
  at most unless ``parallel_tool_calls``) or to the named function's
  arguments, so every call parses and its arguments are valid for the schema.

How one choice's text becomes content and calls, whole or streamed, is
``frontend.tool_reply`` (the required array is read as it arrives by
``frontend.tool_call_array``).

Formats (``--tool-call-parser``; ``auto`` picks one from the chat template):

- ``hermes`` (also Qwen 2/2.5/3 and SmolLM2): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call; a block may also hold a JSON list of calls.
- ``llama3_json``: ``{"name": ..., "parameters": {...}}`` as the whole reply, optionally after
  ``<|python_tag|>``, several calls separated by ``;``.

A chat template that does not use ``tools`` (the default model's) gets the
documented fallback: a system message listing the tools as JSON and asking for
hermes-style ``<tool_call>`` replies; assistant ``tool_calls`` of earlier turns
are rendered back in that form and ``tool`` messages as
``<tool_response>...</tool_response>`` so follow-up turns render.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from backend.types.errors import InvalidRequestError

PARSERS = ("hermes", "llama3_json")
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

FALLBACK_SYSTEM_PROMPT = (
    "You may call functions to help with the user's request. The functions are given as JSON "
    "schemas inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one JSON object per call inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


# ---- the request: tools, tool_choice ---------------------------------------------------------


def check_tools(tools: Optional[list[dict]], tool_choice: Any) -> Optional[str]:
    """Validate ``tools`` and ``tool_choice`` (OpenAI's shapes); return the named function, if any.

    Raises InvalidRequestError naming ``tools`` or ``tool_choice``.
    """
    names = []
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}.", param="tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError(f"tools[{i}].function needs a non-empty name.", param="tools")
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON Schema object.", param="tools")
        names.append(function["name"])
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct function names.", param="tools")
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        if tool_choice in ("auto", "required") and not names:
            raise InvalidRequestError(f"tool_choice={tool_choice!r} needs tools.", param="tool_choice")
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools.",
                                      param="tool_choice")
        return name
    raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}.", param="tool_choice")


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def constrained_tool_schema(tools: list[dict], named: Optional[str], parallel: bool) -> dict:
    """The JSON Schema a ``required`` or named reply is held to."""
    if named is not None:
        return _parameters(next(t for t in tools if t["function"]["name"] == named))
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict = {"type": "array", "items": {"anyOf": calls} if len(calls) > 1 else calls[0], "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def calls_from_constrained(text: str, named: Optional[str]) -> list[ToolCall]:
    """The tool calls in a reply that ``constrained_tool_schema`` held (so it parses). A named call's
    arguments are the text as generated (what its stream sent), checked to parse."""
    if named is not None:
        json.loads(text)
        return [ToolCall(named, text)]
    return [ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in json.loads(text)]


# ---- rendering --------------------------------------------------------------------------------


def template_supports_tools(template: Optional[str]) -> bool:
    return bool(template) and "tools" in template


def choose_parser(name: str, template: Optional[str]) -> str:
    """``auto``: llama3_json for Llama 3 templates, else hermes (the fallback's format too)."""
    if name != "auto":
        if name not in PARSERS:
            raise InvalidRequestError(f"Unknown tool-call parser {name!r}; choose one of auto, {', '.join(PARSERS)}.",
                                      param="tool_call_parser")
        return name
    if template and template_supports_tools(template) and PYTHON_TAG in template:
        return "llama3_json"
    return "hermes"


def messages_for_template(messages: list[dict], tools: Optional[list[dict]], supports_tools: bool) -> list[dict]:
    """Messages ready for the chat template: tool-call arguments as objects (what HF templates
    expect); for a template without tool support, the fallback described above."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_call_with_object_arguments(call) for call in calls]
            if not supports_tools:
                blocks = [TOOL_CALL_START + json.dumps({"name": c["function"].get("name"),
                                                        "arguments": c["function"].get("arguments")},
                                                       ensure_ascii=False) + TOOL_CALL_END
                          for c in message["tool_calls"] if isinstance(c, dict) and isinstance(c.get("function"), dict)]
                message["content"] = "\n".join(filter(None, [_text(message.get("content"))] + blocks))
                del message["tool_calls"]
        if not supports_tools and message.get("role") == "tool":
            message["content"] = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            message.pop("tool_call_id", None)
        if message.get("content") is None and message.get("role") == "assistant":
            message["content"] = ""
        out.append(message)
    if tools and not supports_tools:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        prompt = FALLBACK_SYSTEM_PROMPT.format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _call_with_object_arguments(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {**call, "function": {**call["function"], "arguments": arguments}}


# ---- parsing ----------------------------------------------------------------------------------


def _call_from_json(value: Any) -> Optional[ToolCall]:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _calls_in_json_text(text: str) -> Optional[list[ToolCall]]:
    """A call or a list of calls as JSON; None if the text is not that."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    values = value if isinstance(value, list) else [value]
    calls = [_call_from_json(v) for v in values]
    return calls if calls and all(calls) else None


_HERMES_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def parse_tool_calls(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a whole reply. Text that is not a well-formed call stays content."""
    if parser == "llama3_json":
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):]
        calls, decoder, position = [], json.JSONDecoder(), 0
        while True:  # JSON values separated by ";" (a ";" inside a string is no separator)
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
            if position == len(body):
                break
            try:
                value, position = decoder.raw_decode(body, position)
            except ValueError:
                return text, []
            found = [_call_from_json(v) for v in (value if isinstance(value, list) else [value])]
            if not found or not all(found):
                return text, []
            calls.extend(found)
        return ("", calls) if calls else (text, [])
    calls, content, last = [], [], 0
    for match in _HERMES_BLOCK.finditer(text):
        found = _calls_in_json_text(match.group(1).strip())
        if found is None:
            continue
        content.append(text[last:match.start()])
        calls.extend(found)
        last = match.end()
    content.append(text[last:])
    return "".join(content).strip() if calls else text, calls


class StreamingToolCallParser:
    """Splits a streamed reply into content deltas and tool calls (hermes: as each block closes;
    llama3_json: at the end, when a reply starting like a call turned out to be one)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self._released = 0  # chars of text handed out as content
        self._in_call = False
        self.calls: list[ToolCall] = []

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if self.parser == "llama3_json":
            head = self.text.lstrip()
            if not head or head.startswith(("{", "[", PYTHON_TAG[:len(head)])):
                return "", []  # may be a call: hold until the end
            return self._release(len(self.text)), []
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self.text.find(TOOL_CALL_END, self._released)
                if end < 0:
                    break
                found = _calls_in_json_text(self.text[self._released + len(TOOL_CALL_START):end].strip())
                if found:
                    calls.extend(found)
                    self._released = end + len(TOOL_CALL_END)
                else:  # not a call after all: it is content
                    content.append(self._release(end + len(TOOL_CALL_END)))
                self._in_call = False
                continue
            start = self.text.find(TOOL_CALL_START, self._released)
            if start >= 0:
                piece = self._release(start)
                if piece.strip() or not (self.calls or calls):  # whitespace between calls is dropped
                    content.append(piece)
                self._in_call = True
                continue
            # Hold back a tail that may be the start of the tag.
            held = len(self.text) - self._released
            keep = next((n for n in range(min(len(TOOL_CALL_START) - 1, held), 0, -1)
                         if self.text.endswith(TOOL_CALL_START[:n])), 0)
            content.append(self._release(len(self.text) - keep))
            break
        self.calls.extend(calls)
        text = "".join(content)
        if self.calls and not text.strip():
            text = ""  # whitespace between calls
        return text, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: what is still held (an unclosed block is content), and late calls."""
        if self.parser == "llama3_json":
            content, calls = parse_tool_calls("llama3_json", self.text[self._released:])
            self._released = len(self.text)
            self.calls.extend(calls)
            return ("" if calls else content), calls
        return self._release(len(self.text)), []

    def _release(self, end: int) -> str:
        out = self.text[self._released:end]
        self._released = max(self._released, end)
        return out


# One streamed tool-call piece: (call index, id, name, arguments text); id and name only in a call's first piece.
ToolCallDelta = tuple[int, Optional[str], Optional[str], str]
