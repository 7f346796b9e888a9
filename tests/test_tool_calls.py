"""Tool calling's frontend pieces (frontend/tool_calls.py): validation, schemas, rendering, parsing."""

from __future__ import annotations

import json

import jinja2
import pytest

from backend.types.errors import InvalidRequestError
from frontend.tool_calls import (StreamingToolCallParser, calls_from_constrained, check_tools, choose_parser,
                                 constrained_tool_schema, messages_for_template, parse_tool_calls)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HERMES_REPLY = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
# The default model's template (no tool support) and a Qwen-like one (tools, tool_calls, tool role).
PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
                 "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
                 "{% for c in m.get('tool_calls', []) %}[call {{ c['function']['name'] }} "
                 "{{ c['function']['arguments']['city'] }}]{% endfor %}\n{% endfor %}")


def names(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("tools, choice, message, param", [
    ([{"type": "function"}], "auto", "must be", "tools"),
    ([{"type": "function", "function": {"name": ""}}], "auto", "non-empty name", "tools"),
    ([WEATHER, WEATHER], "auto", "distinct", "tools"),
    (None, "required", "needs tools", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not in tools", "tool_choice"),
    ([WEATHER], "sometimes", "must be", "tool_choice"),
])
def test_bad_tools_and_tool_choice_are_refused_naming_the_field(tools, choice, message, param):
    with pytest.raises(InvalidRequestError, match=message) as error:
        check_tools(tools, choice)
    assert error.value.param == param


def test_named_choice_is_returned():
    assert check_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}) == "get_time"
    assert check_tools([WEATHER], "auto") is None


def test_required_schema_lists_each_tool_and_bounds_parallel_calls():
    schema = constrained_tool_schema([WEATHER, TIME], None, parallel=False)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert "maxItems" not in constrained_tool_schema([WEATHER], None, parallel=True)
    assert constrained_tool_schema([WEATHER, TIME], "get_weather", True) == WEATHER["function"]["parameters"]
    calls = calls_from_constrained('[{"name": "get_time", "parameters": {}}]', None)
    assert names(calls) == [("get_time", {})]
    assert names(calls_from_constrained('{"city": "Oslo"}', "get_weather")) == [("get_weather", {"city": "Oslo"})]


def test_hermes_reply_splits_into_content_and_calls():
    content, calls = parse_tool_calls("hermes", HERMES_REPLY)
    assert content == "Let me check."
    assert names(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert calls[0].id != calls[1].id
    assert parse_tool_calls("hermes", "<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    _, listed = parse_tool_calls("hermes", '<tool_call>[{"name": "a", "arguments": {}}, '
                                           '{"name": "b", "arguments": {"x": 1}}]</tool_call>')
    assert names(listed) == [("a", {}), ("b", {"x": 1})]


def test_llama3_json_reply_with_python_tag_and_separators():
    _, calls = parse_tool_calls("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"s": "x;y"}}; '
                                               '{"name": "b", "parameters": {}}')
    assert names(calls) == [("a", {"s": "x;y"}), ("b", {})]
    assert parse_tool_calls("llama3_json", "Just text.") == ("Just text.", [])


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_streamed_hermes_reply_gives_the_same_content_and_calls(chunk):
    parser = StreamingToolCallParser("hermes")
    content, calls = "", []
    for i in range(0, len(HERMES_REPLY), chunk):
        text, new = parser.push(HERMES_REPLY[i:i + chunk])
        assert "<tool" not in text
        content, calls = content + text, calls + new
    text, new = parser.finish()
    content, calls = content + text, calls + new
    assert content == "Let me check." and names(calls) == names(parse_tool_calls("hermes", HERMES_REPLY)[1])


def test_streamed_llama3_reply_is_held_until_it_is_known():
    parser = StreamingToolCallParser("llama3_json")
    assert parser.push('{"name": "a", ') == ("", [])
    assert parser.push('"parameters": {}}') == ("", [])
    content, calls = parser.finish()
    assert content == "" and names(calls) == [("a", {})]
    plain = StreamingToolCallParser("llama3_json")
    assert plain.push("Hi") == ("Hi", []) and plain.finish() == ("", [])


def test_parser_choice_follows_the_template():
    assert choose_parser("auto", PLAIN_TEMPLATE) == "hermes"
    assert choose_parser("auto", "{{ tools }} <|python_tag|>") == "llama3_json"
    with pytest.raises(InvalidRequestError):
        choose_parser("mystery", PLAIN_TEMPLATE)


FOLLOW_UP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def render(template: str, messages: list[dict]) -> str:
    return jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True)


def test_fallback_renders_tools_calls_and_results_with_a_plain_template():
    text = render(PLAIN_TEMPLATE, messages_for_template(FOLLOW_UP, [WEATHER], supports_tools=False))
    assert text.startswith("<|im_start|>system\n") and '"name": "get_weather"' in text.split("<|im_end|>")[0]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert "None" not in text


def test_a_template_with_tool_support_gets_argument_objects():
    messages = messages_for_template(FOLLOW_UP, [WEATHER], supports_tools=True)
    text = jinja2.Environment().from_string(TOOL_TEMPLATE).render(messages=messages, tools=[WEATHER])
    assert "TOOLS:get_weather;" in text and "[call get_weather Paris]" in text and "tool: 18 C, sunny" in text
    assert FOLLOW_UP[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input untouched
