"""OpenAI's Responses API (/v1/responses, GET and DELETE /v1/responses/{id}) over the chat endpoint.

Against the fake engine of tests/fake_engine.py (a fixed script of tokens;
a test sets the script to the reply it needs, e.g. a tool call): the mapping
onto the chat request, the stream's event contract, tools, the store and
previous_response_id, refusals. The openai SDK's tests are in
tests/test_responses_sdk.py.
"""

from __future__ import annotations

import json

import pytest
from conftest import TINY_VOCAB
from fastapi.testclient import TestClient
from fake_engine import MODEL, FakeEngine, engine, expected_text, tokenizer, tokenizer_dir  # noqa: F401
from test_invalid_unicode import _can_hold_text

from backend.types.outputs import ModelInfo
from frontend.app import create_app
from frontend.protocol import responses as R
from frontend.serving.response_store import LocalResponseStore, StoredResponse

MAX_MODEL_LEN = 2048  # room for the tools' system prompt (long in the tiny vocabulary)
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                  "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": WEATHER_SCHEMA, "strict": True}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": WEATHER_SCHEMA}}
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def make_app(engine: FakeEngine, tokenizer):  # noqa: F811
    return create_app(engine, tokenizer, ModelInfo(MODEL, MAX_MODEL_LEN, TINY_VOCAB, [engine.eos]))


@pytest.fixture
def client(engine, tokenizer):  # noqa: F811
    with TestClient(make_app(engine, tokenizer), raise_server_exceptions=False) as test_client:
        yield test_client


def say(engine: FakeEngine, tokenizer, text: str) -> None:  # noqa: F811
    """The fake engine's next replies are ``text`` (then EOS)."""
    engine.script = tokenizer.encode(text, add_special_tokens=False)


def create(client, **fields) -> dict:
    response = client.post("/v1/responses", json={"model": MODEL, "input": "Hello there", **fields})
    assert response.status_code == 200, response.text
    return response.json()


def response_events(response) -> list[dict]:
    """The events of a Responses SSE body; checks the framing and the sequence numbers."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def check_stream_contract(events: list[dict]) -> dict:
    """created, in_progress first; each item added, its pieces, done, in output order; the last
    event the final response, whose output equals the items streamed. Returns the final response."""
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    items: list[dict] = []
    open_item = None
    for event in events[2:-1]:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert open_item is None and event["output_index"] == len(items)
            open_item = {**event["item"], "text": "", "arguments_streamed": ""}
            assert open_item["status"] == "in_progress"
            continue
        assert open_item is not None and event["output_index"] == len(items), event
        if kind != "response.output_item.done":
            assert event["item_id"] == open_item["id"]
        if kind == "response.content_part.added":
            assert open_item["type"] == "message" and event["part"]["text"] == ""
        elif kind == "response.output_text.delta":
            open_item["text"] += event["delta"]
        elif kind == "response.output_text.done":
            assert event["text"] == open_item["text"]
        elif kind == "response.content_part.done":
            assert event["part"]["text"] == open_item["text"]
        elif kind == "response.function_call_arguments.delta":
            open_item["arguments_streamed"] += event["delta"]
        elif kind == "response.function_call_arguments.done":
            assert event["arguments"] == open_item["arguments_streamed"]
        else:
            assert kind == "response.output_item.done", kind
            done = event["item"]
            if done["type"] == "message":
                assert done["content"][0]["text"] == open_item["text"]
            else:
                assert done["arguments"] == open_item["arguments_streamed"]
            items.append(done)
            open_item = None
    assert open_item is None
    assert final["response"]["output"] == items
    return final["response"]


def without_ids(response: dict) -> dict:
    """A response with its generated IDs and time blanked (two runs of one request differ only there)."""
    response = json.loads(json.dumps(response))
    response["id"] = response["created_at"] = None
    for item in response["output"]:
        item["id"] = None
        if item["type"] == "function_call":
            item["call_id"] = None
    return response


# ---- the mapping onto the chat endpoint ---------------------------------------------------------


def test_a_text_reply_its_usage_and_the_echoed_settings(client, engine, tokenizer):  # noqa: F811
    response = create(client, max_output_tokens=6, temperature=0.5, top_p=0.9, instructions="Be brief.",
                      metadata={"k": "v"}, user="u-1", safety_identifier="s-1")
    _, prompt_ids, params = engine.requests[-1]
    assert (params.max_tokens, params.temperature, params.top_p) == (6, 0.5, 0.9)
    assert response["id"].startswith("resp_") and response["object"] == "response" and response["model"] == MODEL
    (message,) = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    assert message["content"] == [{"type": "output_text", "text": expected_text(engine, tokenizer, prompt_ids, 0, 6),
                                   "annotations": [], "logprobs": []}]
    assert response["status"] == "incomplete" and message["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"] == {"input_tokens": len(prompt_ids), "input_tokens_details": {"cached_tokens": 3},
                                 "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": len(prompt_ids) + 6}
    assert (response["instructions"], response["max_output_tokens"], response["metadata"], response["user"]) == (
        "Be brief.", 6, {"k": "v"}, "u-1")
    assert (response["temperature"], response["top_p"], response["store"]) == (0.5, 0.9, True)
    assert response["tool_choice"] == "none" and response["tools"] == [] and response["error"] is None
    assert tokenizer.decode(prompt_ids).startswith("<|im_start|>system\nBe brief.")


def test_completed_at_eos(client, engine, tokenizer):  # noqa: F811
    say(engine, tokenizer, "Hi!")
    response = create(client, max_output_tokens=50)
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert response["output"][0]["content"][0]["text"] == "Hi!" and response["output"][0]["status"] == "completed"


def test_the_prompt_is_the_chat_endpoints_for_the_same_conversation(client, engine):  # noqa: F811
    """Instructions, message items with text parts, a function call and its output render exactly as
    the OpenAI chat messages would."""
    items = [{"role": "developer", "content": "Use metric units."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
              "id": "fc_1", "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
             {"role": "user", "content": "And tomorrow?"}]
    create(client, input=items, instructions="Be brief.", tools=[WEATHER], max_output_tokens=20)
    chat = {"max_tokens": 20, "tools": [CHAT_WEATHER], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "user", "content": "And tomorrow?"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    (_, ours, _), (_, theirs, _) = engine.requests
    assert ours == theirs


def test_the_stream_contract_and_that_it_equals_the_response(client, engine):  # noqa: F811
    request = {"model": MODEL, "input": "Hello there", "max_output_tokens": 9}
    whole = client.post("/v1/responses", json=request).json()
    final = check_stream_contract(response_events(client.post("/v1/responses", json={**request, "stream": True})))
    assert without_ids(final) == without_ids(whole)
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 9


# ---- tools and structured output ------------------------------------------------------------------


def test_an_auto_tool_call_is_a_function_call_item_streamed_or_not(client, engine, tokenizer):  # noqa: F811
    say(engine, tokenizer, "Checking. " + CALL_TEXT)
    request = {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER], "max_output_tokens": 400}
    whole = client.post("/v1/responses", json=request).json()
    message, call = whole["output"]
    assert message["content"][0]["text"] == "Checking."
    assert (call["type"], call["name"], json.loads(call["arguments"]), call["status"]) == (
        "function_call", "get_weather", {"city": "Paris"}, "completed")
    assert call["id"].startswith("fc_") and call["call_id"] and whole["status"] == "completed"
    assert whole["tool_choice"] == "auto" and whole["tools"] == [WEATHER]
    assert engine.requests[-1][2].structured_outputs is None  # auto: parsed, not constrained
    final = check_stream_contract(response_events(client.post("/v1/responses", json={**request, "stream": True})))
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert json.loads(final["output"][1]["arguments"]) == {"city": "Paris"}


def test_parallel_tool_calls_false_keeps_the_first_call(client, engine, tokenizer):  # noqa: F811
    say(engine, tokenizer, CALL_TEXT + CALL_TEXT.replace("Paris", "Rome"))
    request = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "max_output_tokens": 400}
    both = client.post("/v1/responses", json=request).json()
    assert [json.loads(item["arguments"]) for item in both["output"]] == [{"city": "Paris"}, {"city": "Rome"}]
    request["parallel_tool_calls"] = False
    one = client.post("/v1/responses", json=request).json()
    assert [json.loads(item["arguments"]) for item in one["output"]] == [{"city": "Paris"}]
    final = check_stream_contract(response_events(client.post("/v1/responses", json={**request, "stream": True})))
    assert [json.loads(item["arguments"]) for item in final["output"]] == [{"city": "Paris"}]
    assert final["parallel_tool_calls"] is False


@pytest.mark.parametrize("tool_choice, reply", [
    ({"type": "function", "name": "get_weather"}, '{"city": "Paris"}'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')])
def test_a_named_or_required_tool_is_constrained_and_streams_its_arguments(client, engine, tokenizer, tool_choice,
                                                                          reply):  # noqa: F811
    say(engine, tokenizer, reply)
    request = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "tool_choice": tool_choice,
               "max_output_tokens": 400}
    whole = client.post("/v1/responses", json=request).json()
    assert engine.requests[-1][2].structured_outputs.json is not None
    (call,) = whole["output"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    events = response_events(client.post("/v1/responses", json={**request, "stream": True}))
    final = check_stream_contract(events)
    assert json.loads(final["output"][0]["arguments"]) == {"city": "Paris"}
    assert sum(e["type"] == "response.function_call_arguments.delta" for e in events) > 1  # as it is generated


@pytest.mark.parametrize("text, expected", [
    ({"format": {"type": "json_schema", "name": "city", "schema": WEATHER_SCHEMA, "strict": True}},
     ("json", WEATHER_SCHEMA)),
    ({"format": {"type": "json_object"}}, ("json_object", True)),
    ({"format": {"type": "text"}}, None)])
def test_text_format_is_the_structured_output(client, engine, text, expected):  # noqa: F811
    response = create(client, text=text, max_output_tokens=5)
    constraint = engine.requests[-1][2].structured_outputs
    if expected is None:
        assert constraint is None
    else:
        value = getattr(constraint, expected[0])
        assert (json.loads(value) if isinstance(value, str) else value) == expected[1]
    assert response["text"]["format"]["type"] == text["format"]["type"]


# ---- the store, previous_response_id, GET and DELETE ------------------------------------------------


def test_previous_response_id_replays_the_conversation_without_instructions(client, engine, tokenizer):  # noqa: F811
    say(engine, tokenizer, "Paris is sunny.")
    first = create(client, input="Weather in Paris?", instructions="Be brief.", max_output_tokens=50)
    say(engine, tokenizer, "Rome too.")
    second = create(client, input="And Rome?", previous_response_id=first["id"], max_output_tokens=50)
    assert second["previous_response_id"] == first["id"] and second["instructions"] is None
    chat = {"max_tokens": 50, "messages": [{"role": "user", "content": "Weather in Paris?"},
                                           {"role": "assistant", "content": "Paris is sunny."},
                                           {"role": "user", "content": "And Rome?"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert engine.requests[1][1] == engine.requests[2][1]  # the first's input and output, then the new input
    third = create(client, input="And Oslo?", previous_response_id=second["id"], max_output_tokens=50)
    prompt = tokenizer.decode(engine.requests[-1][1])
    for text in ("Weather in Paris?", "Paris is sunny.", "And Rome?", "Rome too.", "And Oslo?"):
        assert text in prompt
    assert third["status"] == "completed"


def test_get_and_delete_a_stored_response(client):
    first = create(client, max_output_tokens=3)
    assert client.get(f"/v1/responses/{first['id']}").json() == first
    assert client.delete(f"/v1/responses/{first['id']}").json() == {
        "id": first["id"], "object": "response.deleted", "deleted": True}
    for response in (client.get(f"/v1/responses/{first['id']}"), client.delete(f"/v1/responses/{first['id']}")):
        assert response.status_code == 404 and response.json()["error"]["param"] == "response_id"
        assert "not found" in response.json()["error"]["message"]


def test_a_streamed_response_is_stored_when_it_ends(client):
    final = check_stream_contract(response_events(client.post("/v1/responses", json={
        "model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True})))
    assert client.get(f"/v1/responses/{final['id']}").json() == final


def test_store_false_keeps_nothing_and_an_unknown_id_is_a_404(client, engine):  # noqa: F811
    unstored = create(client, store=False, max_output_tokens=3)
    assert unstored["store"] is False
    assert client.get(f"/v1/responses/{unstored['id']}").status_code == 404
    before = len(engine.requests)
    response = client.post("/v1/responses", json={"model": MODEL, "input": "Hi",
                                                  "previous_response_id": unstored["id"]})
    assert response.status_code == 404 and response.json()["error"]["param"] == "previous_response_id"
    assert len(engine.requests) == before


def test_a_stored_response_round_trips_through_its_encoding():
    import asyncio

    conversation = [R.MessageItem(role="user", content="Hi"),
                    R.FunctionCallItem(type="function_call", call_id="c1", name="f", arguments="{}", id="fc_1",
                                       status="completed")]
    entry = StoredResponse({"id": "resp_1", "output": []}, conversation)
    store = LocalResponseStore(max_entries=2, max_bytes=len(entry.encode()))
    assert asyncio.run(store.put("resp_1", entry))
    assert asyncio.run(store.get("resp_1")) == entry
    assert not asyncio.run(store.put("resp_2", StoredResponse({"id": "resp_2", "output": [1]}, conversation)))


# ---- refusals and errors --------------------------------------------------------------------------


@pytest.mark.parametrize("fields, param, words", [
    ({"reasoning": {"effort": "low"}}, "reasoning", ("reasoning is not supported",)),
    ({"background": True}, "background", ("background",)),
    ({"include": ["message.output_text.logprobs"]}, "include", ("include",)),
    ({"truncation": "auto"}, "truncation", ("truncation 'auto'",)),
    ({"conversation": "conv_1"}, "conversation", ("previous_response_id",)),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", ("prompt templates",)),
    ({"max_tool_calls": 2}, "max_tool_calls", ("max_tool_calls",)),
    ({"top_logprobs": 2}, "top_logprobs", ("logprobs",)),
    ({"service_tier": "flex"}, "service_tier", ("service tiers",)),
    ({"prompt_cache_key": "k"}, "prompt_cache_key", ("prompt_cache_key",)),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options", ("obfuscation",)),
    ({"tools": [{"type": "web_search"}]}, "tools", ("'web_search'",)),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools", ("'file_search'",)),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", ("'file_search'",)),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", ("'reasoning'",)),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", ("'item_reference'",)),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     ("'input_image'",)),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", ("'input_file'",)),
    ({"input": [{"role": "user", "content": "Hi", "extra": 1}]}, "input", ("extra",)),
    ({"input": [{"role": "tool", "content": "Hi"}]}, "input", ("role",)),
    ({"input": []}, "input", ("input",)),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text", ("name",)),
    ({"text": {"verbosity": "low"}}, "text", ("verbosity",)),
    ({"temperature": 2.5}, "temperature", ("temperature",)),
    ({"max_output_tokens": 0}, "max_output_tokens", ("max_output_tokens",)),
    ({"max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens", ("too large",)),
    ({"input": "Hello " * 3000}, "input", ("input",)),
    ({"tool_choice": "required"}, "tool_choice", ("needs tools",)),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", ("nope",)),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", ("metadata",)),
    ({"n": 2}, "n", ("Extra inputs",)),
    ({"previous_response_id": ""}, "previous_response_id", ("previous_response_id",)),
])
def test_what_is_not_implemented_is_refused_naming_it(client, engine, fields, param, words):  # noqa: F811
    response = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400, error
    for word in words:
        assert word in error["message"], error
    assert engine.requests == []


def test_refused_fields_are_not_in_the_served_schema(client):
    schema = client.get("/openapi.json").json()["components"]["schemas"]["ResponsesRequest"]
    assert "input" in schema["properties"] and "reasoning" not in schema["properties"]
    assert "background" not in schema["properties"] and schema["additionalProperties"] is False


def test_an_unknown_model_and_the_api_key(engine, tokenizer):  # noqa: F811
    app = create_app(engine, tokenizer, ModelInfo(MODEL, MAX_MODEL_LEN, TINY_VOCAB, [engine.eos]), api_key="s3cret")
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/v1/responses", json={"model": MODEL, "input": "Hi"}).status_code == 401
        assert client.get("/v1/responses/resp_1").status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        response = client.post("/v1/responses", json={"model": "gpt-9", "input": "Hi"}, headers=auth)
        assert response.status_code == 404 and "gpt-9" in response.json()["error"]["message"]
        assert engine.requests == []


def test_an_error_after_the_stream_began_is_a_failed_response(client, engine):  # noqa: F811
    from frontend.grpc_client import BackendUnavailableError
    engine.fail_after_tokens = (3, BackendUnavailableError("Backend unavailable: the connection dropped"))
    events = response_events(client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "stream": True}))
    assert events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "server_error", "message": "Backend unavailable: the connection dropped"}
    assert any(e["type"] == "response.output_text.delta" for e in events)  # the text before it came through
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)
    assert client.get(f"/v1/responses/{failed['id']}").status_code == 404  # only finished responses are kept


BAD = "ok \ud800 there"  # a lone high surrogate: not valid Unicode
UNICODE_CASES = [
    ("model", BAD), ("input", BAD), ("input", [{"role": "user", "content": BAD}]),
    ("input", [{"role": "user", "content": [{"type": "input_text", "text": BAD}]}]),
    ("input", [{"role": "assistant", "content": [{"type": "output_text", "text": BAD}]}]),
    ("input", [{"role": "user", "content": "Hi", "id": BAD}]),
    ("input", [{"type": "function_call", "call_id": BAD, "name": "f", "arguments": "{}"}]),
    ("input", [{"type": "function_call", "call_id": "c", "name": BAD, "arguments": "{}"}]),
    ("input", [{"type": "function_call", "call_id": "c", "name": "f", "arguments": BAD}]),
    ("input", [{"type": "function_call_output", "call_id": "c", "output": BAD}]),
    ("input", [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": BAD}]}]),
    ("instructions", BAD), ("previous_response_id", BAD), ("user", BAD), ("safety_identifier", BAD),
    ("metadata", {"k": BAD}), ("metadata", {BAD: "v"}),
    ("tools", [{"type": "function", "name": BAD}]), ("tools", [{"type": "function", "name": "f", "description": BAD}]),
    ("tools", [{"type": "function", "name": "f", "parameters": {"properties": {BAD: {}}}}]),
    ("tool_choice", {"type": "function", "name": BAD}),
    ("text", {"format": {"type": "json_schema", "name": BAD, "schema": {}}}),
    ("text", {"format": {"type": "json_schema", "name": "x", "schema": {"enum": [BAD]}}}),
] + [(name, BAD) for name in R.UNSUPPORTED_RESPONSES_FIELDS]


@pytest.mark.parametrize("field, value", UNICODE_CASES, ids=[f"{i}-{case[0]}" for i, case in enumerate(UNICODE_CASES)])
def test_text_that_is_not_unicode_is_refused_naming_its_field(client, engine, field, value):  # noqa: F811
    request = {"model": MODEL, "input": "Hi", field: value}
    # ensure_ascii: the lone surrogate is written as its \u escape, as a client would.
    response = client.post("/v1/responses", content=json.dumps(request), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field, error
    if field not in R.UNSUPPORTED_RESPONSES_FIELDS:  # those are refused as such first
        assert "U+D800" in error["message"] or "unicode string" in error["message"], error
    assert engine.requests == []


def test_every_text_field_has_a_unicode_case():
    covered = {field for field, _ in UNICODE_CASES}
    for name, field in R.ResponsesRequest.model_fields.items():
        if _can_hold_text(field.annotation):
            assert name in covered, f"no invalid-Unicode case for {name}"
