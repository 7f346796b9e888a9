"""Tool calling's frontend pieces (frontend/tool_calls.py): validation, schemas, rendering, parsing."""

from __future__ import annotations

import json

import httpx
import jinja2
import openai
import pytest
from conftest import TINY_VOCAB
from helpers import LoopThread, uvicorn_on
from fake_engine import MODEL, FakeEngine, sse_events, tokenizer, tokenizer_dir  # noqa: F401

from backend.types.errors import InvalidRequestError
from backend.types.outputs import ModelInfo
from frontend.app import create_app
from frontend.tool_calls import (StreamingToolCallParser, calls_from_constrained, check_tools, choose_parser,
                                 constrained_tool_schema, messages_for_template, parse_tool_calls)
from frontend.tool_reply import ToolReply, merge_tool_deltas

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


# ---- tool_choice="required": the array of calls read as it arrives (frontend/tool_call_array.py) ----

ARRAY_REPLY = ('[ {"name": "get_weather", "parameters": {"city": "Pa\\"ris", "days": [1, {"a": 2}]}} , '
               '{"parameters": {}, "name": "get_time"}]')


def rebuild(pieces) -> list[tuple[str, dict]]:
    """Calls from streamed pieces, as a client accumulating by index does; checks the id comes first, once."""
    calls: dict[int, dict] = {}
    for index, call_id, name, arguments in pieces:
        if call_id is not None:
            assert index not in calls and name
            calls[index] = {"id": call_id, "name": name, "arguments": ""}
        calls[index]["arguments"] += arguments
    return [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_required_calls_stream_as_they_arrive_whatever_the_chunking(chunk):
    reply = ToolReply("required", "hermes")
    pieces, pushes_with_calls = [], 0
    for i in range(0, len(ARRAY_REPLY), chunk):
        content, new = reply.push(ARRAY_REPLY[i:i + chunk])
        assert content == "" and len({p[0] for p in new}) == len(new)  # one piece per call per push
        pushes_with_calls += bool(new)
        pieces += new
    assert reply.finish() == ("", [])
    expected = [("get_weather", {"city": 'Pa"ris', "days": [1, {"a": 2}]}), ("get_time", {})]
    assert rebuild(pieces) == expected and reply.num_calls == 2
    if chunk == 1:
        assert pushes_with_calls > 10  # the first call's arguments arrived piece by piece, not at the end
    _, whole = ToolReply("required", "hermes").whole(ARRAY_REPLY)
    assert names(whole) == expected


def test_the_first_calls_header_comes_once_its_parameters_begin():
    reply = ToolReply("required", "hermes")
    assert reply.push('[{"name": "get_weather", "parameters": ') == ("", [])
    (piece,) = reply.push('{"ci')[1]
    assert piece[0] == 0 and piece[1] and piece[2] == "get_weather" and piece[3] == '{"ci'
    assert reply.push('ty": "Oslo"}}')[1] == [(0, None, None, 'ty": "Oslo"}')]


def test_a_reply_cut_short_keeps_the_complete_calls():
    cut = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Os'
    content, calls = ToolReply("required", "hermes").whole(cut)
    assert content is None and names(calls) == [("get_time", {})]
    streamed = ToolReply("required", "hermes")
    pieces = streamed.push(cut)[1]
    assert streamed.finish() == ("", []) and [p[2] for p in pieces] == ["get_time", "get_weather"]
    # Cut before any call began: the text, as content.
    assert ToolReply("required", "hermes").whole('[{"name": "get_') == ('[{"name": "get_', [])
    early = ToolReply("required", "hermes")
    assert early.push('[{"name": "get_') == ("", []) and early.finish() == ('[{"name": "get_', [])


def test_merged_pieces_keep_one_entry_per_call():
    pieces = [(0, "id0", "f", ""), (0, None, None, "{"), (1, "id1", "g", "{}"), (0, None, None, "}")]
    assert merge_tool_deltas(pieces) == [(0, "id0", "f", "{}"), (1, "id1", "g", "{}")]
    named = ToolReply("named", "hermes", "get_weather")
    ((index, call_id, name, arguments),) = named.push('{"city"')[1]
    assert (index, name, arguments) == (0, "get_weather", '{"city"') and call_id
    assert named.push(': "Rome"}')[1] == [(0, None, None, ': "Rome"}')]


def test_a_named_call_cut_short_is_still_the_call_whole_or_streamed():
    whole = ToolReply("named", "hermes", "get_weather").whole('{"city": "Ro')
    assert whole[0] is None and names_and_raw(whole[1]) == [("get_weather", '{"city": "Ro')]
    streamed = ToolReply("named", "hermes", "get_weather")
    pieces = streamed.push('{"city"')[1] + streamed.push(': "Ro')[1] + streamed.finish()[1]
    assert [(name, arguments) for _, _, name, arguments in merge_tool_deltas(pieces)] == [("get_weather", '{"city": "Ro')]


@pytest.mark.parametrize("mode, reply, named", [
    ("named", '{\n  "city": "Paris"\n}', "get_weather"),
    ("required", '[ {"name": "get_weather", "parameters": {\n  "city": "Paris" } },\n {"name": "get_time", '
                 '"parameters": { } } ]', None),
])
def test_arguments_whole_are_the_text_streamed(mode, reply, named):
    """A model's whitespace inside the arguments is kept: a client gets the same strings, streamed or not."""
    _, whole = ToolReply(mode, "hermes", named).whole(reply)
    streamed = ToolReply(mode, "hermes", named)
    pieces = [piece for char in reply for piece in streamed.push(char)[1]] + streamed.finish()[1]
    assert [(c.name, c.arguments) for c in whole] == [(name, arguments) for _, _, name, arguments in
                                                      merge_tool_deltas(pieces)]
    assert "\n" in whole[0].arguments and json.loads(whole[0].arguments) == {"city": "Paris"}


def names_and_raw(calls) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in calls]


# ---- the openai SDK's chat.completions.stream() against a live server (the fake engine) ------------

SDK_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
SDK_TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]


@pytest.fixture
def live(tokenizer):  # noqa: F811
    """uvicorn on loopback over the fake engine; yields (openai client, engine)."""
    engine = FakeEngine(tokenizer)
    loop = LoopThread()
    app = create_app(engine, tokenizer, ModelInfo(MODEL, 2048, TINY_VOCAB, [engine.eos]))
    try:
        with uvicorn_on(loop, app) as base_url:
            yield openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30), engine
    finally:
        loop.close()


def say(engine, tokenizer, text: str) -> None:
    engine.script = tokenizer.encode(text, add_special_tokens=False)


def streamed(client, **request):
    """The SDK's stream(): its final completion and the chunks that carried tool calls."""
    tool_chunks = []
    with client.chat.completions.stream(model=MODEL, messages=ASK, max_tokens=400, **request) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices and event.chunk.choices[0].delta.tool_calls:
                tool_chunks.append(event.chunk.choices[0].delta.tool_calls)
        return stream.get_final_completion(), tool_chunks


@pytest.mark.timeout(60)
def test_sdk_stream_with_a_named_tool_keeps_every_piece_of_the_arguments(live, tokenizer):
    client, engine = live
    say(engine, tokenizer, '{"city": "Paris"}')
    final, tool_chunks = streamed(client, tools=[SDK_WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
    assert call.function.parsed_arguments == {"city": "Paris"}  # strict: the SDK parsed it
    assert final.choices[0].finish_reason == "stop"
    for entries in tool_chunks:  # never two entries for one call in a chunk
        assert len({entry.index for entry in entries}) == len(entries)
    assert len(tool_chunks) > 1 and tool_chunks[0][0].function.arguments  # the header brings the first piece


@pytest.mark.timeout(60)
def test_a_named_call_cut_by_max_tokens_comes_back_as_the_call_with_its_arguments_so_far(live, tokenizer):
    client, engine = live
    say(engine, tokenizer, '{"city": "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, tools=[SDK_WEATHER],
                                           tool_choice=named)
    choice = whole.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.message.content is None
    assert '{"city": "Paris"}'.startswith(call.function.arguments) and call.function.arguments
    assert choice.finish_reason == "length"
    chunks = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, tools=[SDK_WEATHER],
                                            tool_choice=named, stream=True)
    arguments = "".join(entry.function.arguments or "" for chunk in chunks if chunk.choices
                        for entry in chunk.choices[0].delta.tool_calls or [])
    assert arguments == call.function.arguments  # streamed and whole alike


@pytest.mark.timeout(60)
def test_sdk_stream_with_required_tools_gets_the_calls_as_they_are_generated(live, tokenizer):
    client, engine = live
    say(engine, tokenizer, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                           '{"name": "get_time", "parameters": {}}]')
    final, tool_chunks = streamed(client, tools=[SDK_WEATHER, SDK_TIME], tool_choice="required")
    calls = final.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert calls[0].id != calls[1].id and final.choices[0].finish_reason == "tool_calls"
    assert len(tool_chunks) > 3  # not one chunk at the end: the arguments streamed
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=400, tools=[SDK_WEATHER, SDK_TIME],
                                           tool_choice="required")
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


@pytest.mark.timeout(60)
def test_sdk_stream_with_auto_tools_parses_parallel_calls(live, tokenizer):
    client, engine = live
    say(engine, tokenizer, 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                           '</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    final, _ = streamed(client, tools=[SDK_WEATHER])
    message = final.choices[0].message
    assert message.content.strip() == "Let me check."
    assert [c.function.parsed_arguments for c in message.tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert final.choices[0].finish_reason == "tool_calls"


@pytest.mark.timeout(60)
def test_a_required_reply_cut_by_max_tokens_returns_its_complete_calls(live, tokenizer):
    client, engine = live
    complete = '[{"name": "get_time", "parameters": {}}, '
    say(engine, tokenizer, complete + '{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    max_tokens = len(tokenizer.encode(complete + '{"name": "get_weather", "parameters": {"ci',
                                      add_special_tokens=False))
    request = dict(model=MODEL, messages=ASK, max_tokens=max_tokens, tools=[SDK_TIME], tool_choice="required")
    whole = client.chat.completions.create(**request)
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.content is None
    calls = whole.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_time", "{}")]
    # The SDK's stream() raises at a "length" finish, with what it accumulated.
    with client.chat.completions.stream(**request) as stream, pytest.raises(openai.LengthFinishReasonError) as cut:
        stream.get_final_completion()
    final = cut.value.completion
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "length" and not final.choices[0].message.content
    assert calls[0].function.name == "get_time" and calls[0].function.arguments == "{}"
    assert calls[1].function.name == "get_weather"  # the cut call, as far as it got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script, tool_choice, role_content", [
    ('{"city": "Paris"}', {"type": "function", "function": {"name": "get_weather"}}, None),
    ('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "required", None),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', "auto", ""),
])
def test_a_streamed_call_has_no_empty_content(live, tokenizer, script, tool_choice, role_content):
    """OpenAI's shape: a reply that can only be calls (named, required) starts with content null;
    with auto, where the reply may be text, the role chunk keeps vLLM's "" (as plain text does).
    No chunk of the call after it carries content."""
    client, engine = live
    say(engine, tokenizer, script)
    answer = httpx.post(f"{client.base_url}chat/completions", timeout=30, json={
        "model": MODEL, "messages": ASK, "max_tokens": 400, "stream": True, "n": 2, "tools": [SDK_WEATHER],
        "tool_choice": tool_choice})
    deltas = [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in sse_events(answer)[:-1]]
    assert [d for _, d in deltas[:2]] == [{"role": "assistant", "content": role_content}] * 2
    assert {i for i, _ in deltas[:2]} == {0, 1}
    first = [d for i, d in deltas[2:] if i == 0]  # the fake engine shifts choice 1's script: not a call
    assert first and all("content" not in d and "role" not in d for d in first)
    arguments = "".join(c["function"]["arguments"] for d in first for c in d.get("tool_calls", []))
    assert json.loads(arguments) == {"city": "Paris"}
