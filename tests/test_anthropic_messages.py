"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over the chat endpoint.

Against the fake engine of tests/fake_engine.py (a fixed script of tokens;
a test sets the script to the reply it needs, e.g. a tool call): the exact
shapes and mapping over raw HTTP (Starlette's TestClient). The ``anthropic``
SDK's tests are in tests/test_anthropic_sdk.py.
"""

from __future__ import annotations

import json

import pytest
from conftest import TINY_VOCAB
from fastapi.testclient import TestClient
from test_invalid_unicode import _can_hold_text
from fake_engine import MODEL, FakeEngine, engine, expected_text, tokenizer, tokenizer_dir  # noqa: F401

from backend.types.limits import Limits
from backend.types.outputs import ModelInfo
from frontend.app import create_app
from frontend.protocol import anthropic as A
from frontend.grpc_client import BackendOverloadedError, BackendUnavailableError

MAX_MODEL_LEN = 2048  # room for the tools' system prompt (long in the tiny vocabulary)
USER = [{"role": "user", "content": "Hello there"}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The current weather in a city.", "input_schema": WEATHER_SCHEMA}
OPENAI_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                                   "parameters": WEATHER_SCHEMA}}
CITY_TOOL = {"name": "get_weather", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "London", "Rome"]}}, "required": ["city"]}}
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def make_app(engine: FakeEngine, tokenizer, api_key=None):
    return create_app(engine, tokenizer, ModelInfo(MODEL, MAX_MODEL_LEN, TINY_VOCAB, [engine.eos]), api_key=api_key)


@pytest.fixture
def client(engine, tokenizer):  # noqa: F811
    with TestClient(make_app(engine, tokenizer), raise_server_exceptions=False) as test_client:
        yield test_client


def body(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 20, "messages": USER, **fields}


def say(engine: FakeEngine, tokenizer, text: str) -> None:
    """The fake engine's next replies are ``text`` (then EOS)."""
    engine.script = tokenizer.encode(text, add_special_tokens=False)


def anthropic_events(response) -> list[dict]:
    """The events of an Anthropic SSE body; checks the framing (``event:`` names the data's type)."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("\n\n")
    events = []
    for block in response.text.split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        events.append(data)
    return events


def check_stream_contract(events: list[dict]) -> tuple[list[dict], dict]:
    """message_start first; each block started, given its deltas and stopped, in index order;
    message_delta then message_stop last. Returns the blocks put together and the message_delta."""
    assert events[0]["type"] == "message_start" and events[0]["message"]["content"] == []
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    blocks: list[dict] = []
    open_index = None
    for event in events[1:-2]:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == len(blocks)
            open_index = event["index"]
            blocks.append({**event["content_block"], "partial_json": ""})
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
            block, delta = blocks[open_index], event["delta"]
            if delta["type"] == "text_delta":
                assert block["type"] == "text"
                block["text"] += delta["text"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                block["partial_json"] += delta["partial_json"]
        else:
            assert event["type"] == "content_block_stop" and event["index"] == open_index
            open_index = None
    assert open_index is None
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["partial_json"])
        del block["partial_json"]
    return blocks, events[-2]


def assert_anthropic_error(response, status: int, error_type: str, *words: str) -> str:
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == error_type
    message = payload["error"]["message"]
    for word in words:
        assert word in message, message
    return message


def count(client, **fields) -> int:
    fields.pop("max_tokens", None)
    response = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": USER, **fields})
    assert response.status_code == 200, response.text
    return response.json()["input_tokens"]


# ---- the mapping onto the chat endpoint ---------------------------------------------------------


def test_a_text_reply_its_usage_and_the_sampling_fields(client, engine, tokenizer):
    response = client.post("/v1/messages", json=body(max_tokens=6, temperature=0.5, top_p=0.9, top_k=7,
                                                     metadata={"user_id": "u-1"}))
    assert response.status_code == 200, response.text
    message = response.json()
    _, prompt_ids, params = engine.requests[-1]
    assert message["id"].startswith("msg_") and message["type"] == "message" and message["role"] == "assistant"
    assert message["model"] == MODEL
    assert message["content"] == [{"type": "text", "text": expected_text(engine, tokenizer, prompt_ids, 0, 6)}]
    assert message["stop_reason"] == "max_tokens" and message["stop_sequence"] is None
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (6, 0.5, 0.9, 7)
    # The prefix cache served 3 prompt tokens (the fake says so): Anthropic counts them apart.
    assert message["usage"] == {"input_tokens": len(prompt_ids) - 3, "output_tokens": 6,
                                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 3}
    assert count(client) == len(prompt_ids)


def test_the_prompt_is_the_chat_endpoints_for_the_same_conversation(client, engine):
    """system (blocks), text blocks, a tool call and its result render exactly as the OpenAI messages would."""
    anthropic_request = body(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}], tools=[WEATHER],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                  {"role": "assistant", "content": [
                      {"type": "text", "text": "Let me look."},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                      {"type": "text", "text": "And tomorrow?"}]}])
    openai_request = {"max_tokens": 20, "tools": [OPENAI_WEATHER], "messages": [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "And tomorrow?"}]}
    assert client.post("/v1/messages", json=anthropic_request).status_code == 200
    assert client.post("/v1/chat/completions", json=openai_request).status_code == 200
    (_, ours, _), (_, theirs, _) = engine.requests
    assert ours == theirs
    assert count(client, **anthropic_request) == len(ours)


def test_an_error_result_reads_as_one_and_a_last_assistant_turn_is_continued(client, engine, tokenizer):
    request = body(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "timeout",
                                      "is_error": True}]},
        {"role": "assistant", "content": "The answer is"}], tools=[WEATHER])
    assert client.post("/v1/messages", json=request).status_code == 200
    prompt = tokenizer.decode(engine.requests[-1][1])
    assert "Error: timeout" in prompt
    assert prompt.endswith("The answer is")  # Anthropic's prefill: no end of turn, no new assistant header
    assert count(client, **request) == len(engine.requests[-1][1])


def test_end_turn_at_eos(client, engine, tokenizer):
    say(engine, tokenizer, "Hi!")
    message = client.post("/v1/messages", json=body(max_tokens=50)).json()
    assert message["content"] == [{"type": "text", "text": "Hi!"}]
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None


def test_stop_sequences_cut_the_text_and_are_named(client, engine):
    message = client.post("/v1/messages", json=body(max_tokens=50, stop_sequences=["ocean", "France"])).json()
    assert message["content"] == [{"type": "text", "text": "The capital of "}]
    assert message["stop_reason"] == "stop_sequence" and message["stop_sequence"] == "France"
    assert engine.requests[-1][2].stop == ["ocean", "France"]
    assert len(engine.closed_early) == 1  # the engine request was aborted at the stop


def test_the_stream_contract_and_that_it_equals_the_message(client):
    request = body(max_tokens=9, stop_sequences=["ocean"])
    message = client.post("/v1/messages", json=request).json()
    events = anthropic_events(client.post("/v1/messages", json={**request, "stream": True}))
    blocks, delta = check_stream_contract(events)
    assert blocks == message["content"]
    assert delta["delta"] == {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    assert delta["usage"] == message["usage"]
    start = events[0]["message"]
    assert start["usage"]["input_tokens"] == message["usage"]["input_tokens"] and start["usage"]["output_tokens"] == 0
    assert start["model"] == MODEL and start["id"].startswith("msg_") and start["stop_reason"] is None


# ---- tools --------------------------------------------------------------------------------------


def test_an_auto_tool_call_is_a_tool_use_block_streamed_or_not(client, engine, tokenizer):
    say(engine, tokenizer, "Checking. " + CALL_TEXT)
    request = body(max_tokens=400, tools=[WEATHER])
    message = client.post("/v1/messages", json=request).json()
    (text, call) = message["content"]
    assert text == {"type": "text", "text": "Checking."}
    assert call["type"] == "tool_use" and call["name"] == "get_weather" and call["input"] == {"city": "Paris"}
    assert call["id"]
    assert message["stop_reason"] == "tool_use"
    assert engine.requests[-1][2].structured_outputs is None  # auto: parsed, not constrained
    blocks, delta = check_stream_contract(anthropic_events(client.post("/v1/messages",
                                                                       json={**request, "stream": True})))
    assert [b["type"] for b in blocks] == ["text", "tool_use"] and blocks[0]["text"].strip() == "Checking."
    assert (blocks[1]["name"], blocks[1]["input"]) == ("get_weather", {"city": "Paris"})
    assert delta["delta"]["stop_reason"] == "tool_use"


def test_disable_parallel_tool_use_keeps_one_call(client, engine, tokenizer):
    say(engine, tokenizer, CALL_TEXT + CALL_TEXT.replace("Paris", "Rome"))
    request = body(max_tokens=400, tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    message = client.post("/v1/messages", json=request).json()
    assert [(b["type"], b["input"]) for b in message["content"]] == [("tool_use", {"city": "Paris"})]
    blocks, _ = check_stream_contract(anthropic_events(client.post("/v1/messages", json={**request, "stream": True})))
    assert [b["input"] for b in blocks] == [{"city": "Paris"}]
    # Without it, both calls.
    both = client.post("/v1/messages", json=body(max_tokens=400, tools=[WEATHER])).json()
    assert [b["input"] for b in both["content"]] == [{"city": "Paris"}, {"city": "Rome"}]


def test_a_named_tool_is_constrained_to_its_schema_and_streams_its_input(client, engine, tokenizer):
    say(engine, tokenizer, '{"city": "Paris"}')  # what the constraint lets the model write
    request = body(max_tokens=400, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    message = client.post("/v1/messages", json=request).json()
    assert json.loads(engine.requests[-1][2].structured_outputs.json) == WEATHER_SCHEMA
    (call,) = message["content"]
    assert (call["name"], call["input"]) == ("get_weather", {"city": "Paris"})
    assert message["stop_reason"] == "tool_use"
    events = anthropic_events(client.post("/v1/messages", json={**request, "stream": True}))
    blocks, delta = check_stream_contract(events)
    assert [(b["name"], b["input"]) for b in blocks] == [("get_weather", {"city": "Paris"})]
    assert sum(e["type"] == "content_block_delta" for e in events) > 1  # the input arrives as it is generated
    assert delta["delta"]["stop_reason"] == "tool_use"


def test_a_named_tool_cut_by_max_tokens_gives_its_input_so_far_as_text(client, engine, tokenizer):
    say(engine, tokenizer, '{"city": "Paris"}')
    request = body(max_tokens=3, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    response = client.post("/v1/messages", json=request)
    assert response.status_code == 200, response.text
    message = response.json()
    ((block_type, text),) = [(b["type"], b.get("text")) for b in message["content"]]
    assert block_type == "text" and '{"city": "Paris"}'.startswith(text) and text
    assert message["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("tool_choice, max_items", [({"type": "any"}, None),
                                                    ({"type": "any", "disable_parallel_tool_use": True}, 1)])
def test_any_requires_a_call(client, engine, tokenizer, tool_choice, max_items):
    say(engine, tokenizer, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    message = client.post("/v1/messages", json=body(max_tokens=400, tools=[WEATHER], tool_choice=tool_choice)).json()
    schema = json.loads(engine.requests[-1][2].structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema.get("maxItems") == max_items
    assert [(b["name"], b["input"]) for b in message["content"]] == [("get_weather", {"city": "Paris"})]
    assert message["stop_reason"] == "tool_use"


def test_tool_choice_none_renders_tools_but_never_calls(client, engine, tokenizer):
    say(engine, tokenizer, CALL_TEXT)
    message = client.post("/v1/messages", json=body(max_tokens=400, tools=[WEATHER],
                                                    tool_choice={"type": "none"})).json()
    assert message["content"] == [{"type": "text", "text": CALL_TEXT}] and message["stop_reason"] == "end_turn"
    assert "get_weather" in tokenizer.decode(engine.requests[-1][1])


# ---- refusals and errors ------------------------------------------------------------------------


@pytest.mark.parametrize("fields, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
     ("messages.0", "'image'", "not supported")),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, ("'document'",)),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}]}, ("'thinking'",)),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, ("thinking", "not supported")),
    ({"output_config": {"format": {"type": "json_schema"}}}, ("output_config",)),
    ({"service_tier": "auto"}, ("service_tier",)),
    ({"mcp_servers": [{"url": "http://x"}]}, ("mcp_servers",)),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, ("tools.0", "web_search_20250305")),
    ({"tools": [{**WEATHER, "strict": True}]}, ("tools.0.strict",)),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, ("input_schema", "object")),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi",
                                                 "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]},
     ("cache_control.ttl",)),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "citations": []}]}]},
     ("citations",)),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     ("tool_use blocks belong in assistant turns",)),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     ("tool_result blocks belong in user turns",)),
    ({"messages": [{"role": "system", "content": "Hi"}]}, ("messages.0.role",)),
    ({"messages": []}, ("messages",)),
    ({"metadata": {"user_id": "u", "session": "s"}}, ("metadata.session",)),
    ({"temperature": 1.5}, ("temperature",)),
    ({"top_k": 0}, ("top_k",)),
    ({"max_tokens": 0}, ("max_tokens",)),
    ({"max_tokens": None}, ("max_tokens",)),
    ({"max_tokens": MAX_MODEL_LEN}, ("max_tokens", "too large")),
    ({"stop_sequences": ["a"] * 65}, ("stop_sequences", "--max-stop-sequences")),
    ({"tool_choice": {"type": "any"}}, ("tool_choice", "needs tools")),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, ("tool_choice", "name")),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, ("tool_choice", "nope")),
    ({"n": 2}, ("n", "Extra inputs")),
    ({"logprobs": True}, ("logprobs",)),
])
def test_what_is_not_implemented_is_refused_naming_it(client, engine, fields, words):
    request = body(**fields)
    if request["max_tokens"] is None:
        del request["max_tokens"]
    assert_anthropic_error(client.post("/v1/messages", json=request), 400, "invalid_request_error", *words)
    assert engine.requests == []


BAD = "ok \ud800 there"  # a lone high surrogate: not valid Unicode
UNICODE_CASES = [
    ("model", BAD), ("system", BAD), ("system", [{"type": "text", "text": BAD}]), ("stop_sequences", ["a", BAD]),
    ("messages", [{"role": "user", "content": BAD}]),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": BAD}]}]),
    ("messages", [{"role": "assistant", "content": [{"type": "tool_use", "id": BAD, "name": "f", "input": {}}]}]),
    ("messages", [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": BAD, "input": {}}]}]),
    ("messages", [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                     "input": {BAD: 1}}]}]),
    ("messages", [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": BAD}]}]),
    ("messages", [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": BAD}]}]),
    ("messages", [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                "content": [{"type": "text", "text": BAD}]}]}]),
    ("tools", [{"name": BAD, "input_schema": {"type": "object"}}]),
    ("tools", [{"name": "f", "description": BAD, "input_schema": {"type": "object"}}]),
    ("tools", [{"name": "f", "input_schema": {"type": "object", "properties": {BAD: {}}}}]),
    ("tool_choice", {"type": "tool", "name": BAD}), ("metadata", {"user_id": BAD}),
]


@pytest.mark.parametrize("field, value", UNICODE_CASES, ids=[f"{i}-{case[0]}" for i, case in enumerate(UNICODE_CASES)])
def test_text_that_is_not_unicode_is_refused_naming_its_field(client, engine, field, value):
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        request = {"model": MODEL, "messages": USER, **({"max_tokens": 2} if route == "/v1/messages" else {})}
        if field not in A.AnthropicCountTokensRequest.model_fields and route != "/v1/messages":
            continue
        request[field] = value
        # ensure_ascii: the lone surrogate is written as its \u escape, as a client would.
        response = client.post(route, content=json.dumps(request), headers={"content-type": "application/json"})
        message = assert_anthropic_error(response, 400, "invalid_request_error", field)
        assert "U+D800" in message or "unicode string" in message, message  # ours, or pydantic's constrained str
    assert engine.requests == []


def test_every_text_field_has_a_unicode_case():
    covered = {field for field, _ in UNICODE_CASES}
    for model in (A.AnthropicMessagesRequest, A.AnthropicCountTokensRequest):
        for name, field in model.model_fields.items():
            if _can_hold_text(field.annotation) and name != "cache_control":  # a Literal: no free text
                assert name in covered, f"no invalid-Unicode case for {name}"


def test_count_tokens_refuses_the_same_and_knows_only_the_served_model(client):
    assert_anthropic_error(client.post("/v1/messages/count_tokens", json={
        "model": MODEL, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
        400, "invalid_request_error", "thinking")
    assert_anthropic_error(client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": USER,
                                                                          "max_tokens": 5}),
                           400, "invalid_request_error", "max_tokens")
    assert_anthropic_error(client.post("/v1/messages/count_tokens", json={"model": "claude-x", "messages": USER}),
                           404, "not_found_error", "claude-x")


def test_bad_json_and_unknown_models(client):
    assert_anthropic_error(client.post("/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"}),
                           400, "invalid_request_error", "not valid JSON")
    assert_anthropic_error(client.post("/v1/messages", json=body(model="claude-opus-4")), 404, "not_found_error",
                           "claude-opus-4")


@pytest.mark.parametrize("error, status, error_type", [
    (BackendOverloadedError("The waiting queue is full."), 429, "rate_limit_error"),
    (BackendUnavailableError("Backend unavailable: connection refused"), 503, "api_error"),
    (RuntimeError("a bug"), 500, "api_error"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_errors_before_the_first_token_get_their_status(client, engine, error, status, error_type, stream):
    engine.fail_before_first = error
    response = client.post("/v1/messages", json=body(stream=stream))
    assert_anthropic_error(response, status, error_type)
    if status == 429:
        assert int(response.headers["retry-after"]) > 0


def test_an_error_after_the_stream_began_is_an_error_event(client, engine):
    engine.fail_after_tokens = (3, BackendUnavailableError("Backend unavailable: the connection dropped"))
    events = anthropic_events(client.post("/v1/messages", json=body(stream=True)))
    assert events[0]["type"] == "message_start"
    assert events[-1] == {"type": "error", "error": {"type": "api_error",
                                                     "message": "Backend unavailable: the connection dropped"}}
    assert not any(e["type"] in ("message_delta", "message_stop") for e in events)
    assert any(e["type"] == "content_block_delta" for e in events)  # the text before it came through


def test_the_api_key_guards_the_routes(engine, tokenizer):
    with TestClient(make_app(engine, tokenizer, api_key="s3cret"), raise_server_exceptions=False) as client:
        assert_anthropic_error(client.post("/v1/messages", json=body()), 401, "authentication_error", "API key")
        assert_anthropic_error(client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": USER}),
                               401, "authentication_error")
        # Other routes keep OpenAI's shape.
        assert client.post("/v1/chat/completions", json={"messages": USER}).json()["error"]["code"] == 401
        assert engine.requests == []
        response = client.post("/v1/messages", json=body(), headers={"Authorization": "Bearer s3cret"})
        assert response.status_code == 200, response.text
        # Anthropic's clients send the key as x-api-key; a wrong one is refused like a missing one.
        assert_anthropic_error(client.post("/v1/messages", json=body(), headers={"x-api-key": "s3cret!"}),
                               401, "authentication_error")
        assert len(engine.requests) == 1
        response = client.post("/v1/messages", json=body(), headers={"x-api-key": "s3cret"})
        assert response.status_code == 200, response.text


def test_the_edge_refuses_a_body_too_large_in_anthropics_shape(engine, tokenizer):
    app = create_app(engine, tokenizer, ModelInfo(MODEL, MAX_MODEL_LEN, TINY_VOCAB, [engine.eos]),
                     limits=Limits(max_request_body_bytes=1024))
    with TestClient(app, raise_server_exceptions=False) as client:
        request = body(messages=[{"role": "user", "content": "x" * 2048}])
        assert_anthropic_error(client.post("/v1/messages", json=request), 413, "request_too_large",
                               "--max-request-body-bytes")
    assert engine.requests == []
