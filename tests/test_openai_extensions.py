"""vLLM's extensions of the OpenAI API on the HTTP frontend (fake engine): each takes effect or is a 400.

Written from vLLM's documented behaviour; the live-client acceptance tests are in test_clients.py.
"""

from __future__ import annotations

import copy
import json

import pytest
from conftest import TINY_VOCAB
from fastapi.testclient import TestClient
from fake_engine import CHAT, MODEL, assert_openai_error, engine, sse_events, tokenizer, tokenizer_dir  # noqa: F401

from backend.types.outputs import ModelInfo
from frontend.app import create_app
from frontend.protocol import UNSUPPORTED_FIELDS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture
def client(engine, tokenizer):
    """Room for the tool-listing system prompt the fallback template gets (the tiny vocabulary is verbose)."""
    info = ModelInfo(MODEL, 2048, TINY_VOCAB, [engine.eos])
    with TestClient(create_app(engine, tokenizer, info), raise_server_exceptions=False) as test_client:
        yield test_client


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4, **body})


def completion(client, **body):
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, **body})


# ---- what is refused ----------------------------------------------------------------------------


def test_an_unknown_field_is_refused_naming_it(client):
    assert_openai_error(chat(client, not_a_field=1), 400, "BadRequestError", "not_a_field")
    assert_openai_error(completion(client, guided_jsn={}), 400, "BadRequestError", "guided_jsn")


@pytest.mark.parametrize("name, value", [("allowed_token_ids", [1]),
                                         ("bad_words", ["x"]), ("priority", 3), ("reasoning_effort", "low"),
                                         ("functions", [{"name": "f"}])])
def test_a_vllm_field_tandem_does_not_implement_is_a_400_naming_it(client, name, value):
    assert name in UNSUPPORTED_FIELDS
    error = assert_openai_error(chat(client, **{name: value}), 400, "BadRequestError", name)
    assert name in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
])
def test_vllms_validation(client, body, param):
    assert_openai_error(completion(client, **body), 400, "BadRequestError", param)


@pytest.mark.parametrize("prompt", ["", [], [[]]])
def test_an_empty_prompt_names_prompt_and_prompt_embeds_as_vllm_does(client, prompt):
    error = assert_openai_error(completion(client, prompt=prompt), 400, "BadRequestError", "prompt")
    assert "Either prompt or prompt_embeds must be provided and non-empty" in error["message"]


@pytest.mark.parametrize("fields", [
    {"prompt": None}, {"prompt": None, "prompt_embeds": []}, {"prompt": None, "prompt_embeds": ""},
    {"prompt_embeds": []}, {"prompt_embeds": None}, {}, {"prompt": "", "prompt_embeds": []},
    {"prompt": [], "prompt_embeds": ""},
])
def test_a_null_or_missing_prompt_and_empty_prompt_embeds_get_the_empty_prompt_error(client, engine, fields):
    """vLLM answers every form of "no prompt" with the one 400 naming both fields, before any work."""
    body = {"model": MODEL, "max_tokens": 4, **fields}
    error = assert_openai_error(client.post("/v1/completions", json=body), 400, "BadRequestError", "prompt")
    assert "Either prompt or prompt_embeds must be provided and non-empty" in error["message"]
    assert "prompt_embeds are not supported" in error["message"] and not engine.requests


@pytest.mark.parametrize("fields", [{"prompt": None, "prompt_embeds": "AAAA"}, {"prompt": "Hi", "prompt_embeds": []},
                                    {"prompt_embeds": ["AAAA"]}])
def test_prompt_embeds_that_are_not_empty_or_beside_a_prompt_are_refused_as_unsupported(client, engine, fields):
    body = {"model": MODEL, "max_tokens": 4, **fields}
    error = assert_openai_error(client.post("/v1/completions", json=body), 400, "BadRequestError", "prompt_embeds")
    assert "prompt_embeds are not supported" in error["message"] and not engine.requests


def test_max_tokens_zero_needs_echo(client):
    assert_openai_error(completion(client, max_tokens=0), 400, "BadRequestError", "max_tokens")


def test_user_is_accepted(client):
    assert completion(client, user="someone").status_code == 200


# ---- structured outputs and tools reach the engine ---------------------------------------------


def test_response_format_and_structured_outputs_become_the_engines_constraint(client, engine):
    assert chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
                ).status_code == 200
    assert json.loads(engine.requests[-1][2].structured_outputs.json) == SCHEMA
    assert completion(client, response_format={"type": "json_object"}).status_code == 200
    assert engine.requests[-1][2].structured_outputs.json_object is True
    assert completion(client, response_format={"type": "text"}).status_code == 200
    assert engine.requests[-1][2].structured_outputs is None
    assert completion(client, structured_outputs={"choice": ["yes", "no"]}).status_code == 200
    assert engine.requests[-1][2].structured_outputs.choice == ["yes", "no"]
    assert chat(client, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}).status_code == 200
    assert engine.requests[-1][2].structured_outputs.disable_any_whitespace is True


def test_required_and_named_tool_choice_constrain_the_reply(client, engine):
    assert chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).status_code == 200
    schema = json.loads(engine.requests[-1][2].structured_outputs.json)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(client, tools=[WEATHER], tool_choice=named).status_code == 200
    assert json.loads(engine.requests[-1][2].structured_outputs.json) == WEATHER["function"]["parameters"]
    assert chat(client, tools=[WEATHER], tool_choice="auto").status_code == 200
    assert engine.requests[-1][2].structured_outputs is None
    assert_openai_error(chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
                        400, "BadRequestError", "tool_choice")


def test_auto_tool_calls_are_parsed_whole_and_streamed(client, engine, tokenizer):
    reply = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    engine.script = tokenizer.encode(reply, add_special_tokens=False)
    body = chat(client, tools=[WEATHER], max_tokens=200).json()
    message = body["choices"][0]["message"]
    assert message["content"] == "Checking." and body["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"} and call["id"]

    events = sse_events(chat(client, tools=[WEATHER], max_tokens=200, stream=True))
    content, calls, finish = "", {}, None
    for event in events[:-1]:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                entry = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
                entry["name"] += piece.get("function", {}).get("name") or ""
                entry["arguments"] += piece.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    assert content == "Checking." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]


def test_a_follow_up_turn_with_tool_calls_and_a_tool_result_renders(client, engine, tokenizer):
    messages = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    response = client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "max_tokens": 3})
    assert response.status_code == 200, response.text
    prompt = tokenizer.decode(engine.requests[-1][1])
    assert "<tool_call>" in prompt and "18 C" in prompt and '"get_weather"' in prompt


# ---- logprob and token extensions ----------------------------------------------------------------


def test_echo_with_max_tokens_zero_scores_the_prompt(client, engine, tokenizer):
    body = completion(client, prompt="Hello there", max_tokens=0, echo=True, logprobs=1).json()
    (choice,) = body["choices"]
    prompt_ids = tokenizer.encode("Hello there")
    assert choice["text"] == "Hello there"
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt_ids)
    assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["token_logprobs"][1] == -0.25
    assert body["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    assert engine.requests[-1][2].prompt_logprobs == 1


def test_prompt_logprobs_on_completions_and_chat(client, tokenizer):
    choice = completion(client, prompt_logprobs=0).json()["choices"][0]
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(tokenizer.encode("Hi"))
    body = chat(client, prompt_logprobs=1).json()
    assert body["prompt_logprobs"][0] is None
    assert all(entry["logprob"] <= 0 for position in body["prompt_logprobs"][1:] for entry in position.values())
    assert chat(client).json()["prompt_logprobs"] is None  # always present, null unless asked


def test_return_token_ids_and_tokens_as_token_ids(client, engine, tokenizer):
    body = completion(client, return_token_ids=True, logprobs=0, return_tokens_as_token_ids=True).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode("Hi") and len(choice["token_ids"]) == 4
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    body = chat(client, return_token_ids=True).json()
    assert body["prompt_token_ids"] == engine.requests[-1][1] and len(body["choices"][0]["token_ids"]) == 4


def test_logprob_token_ids_ask_for_those_tokens(client, engine):
    body = completion(client, logprob_token_ids=[3, 4]).json()
    assert engine.requests[-1][2].logprob_token_ids == [3, 4] and engine.requests[-1][2].logprobs is None
    assert body["choices"][0]["logprobs"]["token_logprobs"]
    assert_openai_error(chat(client, logprob_token_ids=[3]), 400, "BadRequestError", "logprob_token_ids")


def test_logit_bias_reaches_the_engine_with_integer_token_ids(client, engine):
    assert completion(client, logit_bias={"3": -100, "4": 2.5}).status_code == 200
    assert engine.requests[-1][2].logit_bias == {3: -100.0, 4: 2.5}
    assert chat(client, logit_bias={"7": 100}).status_code == 200
    assert engine.requests[-1][2].logit_bias == {7: 100.0}
    assert completion(client, logit_bias={}).status_code == 200 and engine.requests[-1][2].logit_bias is None


@pytest.mark.parametrize("bias", [{"x": 1.0}, {"-1": 1.0}, {"3": 101}, {"3": -100.5},
                                  {str(i): 1.0 for i in range(301)}])
def test_a_bad_logit_bias_is_a_400_naming_it(client, bias):
    assert_openai_error(completion(client, logit_bias=bias), 400, "BadRequestError", "logit_bias")
    assert_openai_error(chat(client, logit_bias=bias), 400, "BadRequestError", "logit_bias")


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, engine, tokenizer):
    prompt = "The capital of France is Paris."
    assert completion(client, prompt=prompt, truncate_prompt_tokens=3).status_code == 200
    assert engine.requests[-1][1] == tokenizer.encode(prompt)[-3:]


def test_truncation_side_picks_the_end_truncate_prompt_tokens_keeps(client, engine, tokenizer):
    """vLLM's truncation_side: "left" (the default) drops the first tokens, "right" the last."""
    prompt = "The capital of France is Paris."
    ids = tokenizer.encode(prompt)
    for side, kept in (("left", ids[-3:]), ("right", ids[:3]), (None, ids[-3:])):
        assert completion(client, prompt=prompt, truncate_prompt_tokens=3, truncation_side=side).status_code == 200
        assert engine.requests[-1][1] == kept, side
    assert completion(client, prompt=prompt, truncation_side="right").status_code == 200  # nothing to cut
    assert engine.requests[-1][1] == ids
    rendered = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert chat(client, truncate_prompt_tokens=4, truncation_side="right").status_code == 200
    assert engine.requests[-1][1] == rendered[:4]
    assert chat(client, truncate_prompt_tokens=4, truncation_side="left").status_code == 200
    assert engine.requests[-1][1] == rendered[-4:]
    assert_openai_error(completion(client, truncate_prompt_tokens=3, truncation_side="middle"), 400,
                        "BadRequestError", "truncation_side")


@pytest.mark.parametrize("endpoint", [completion, chat])
def test_continuous_usage_stats_alone_adds_no_usage_as_in_vllm(client, endpoint):
    """vLLM reads continuous_usage_stats only together with include_usage."""
    events = sse_events(endpoint(client, stream=True, stream_options={"continuous_usage_stats": True}))
    assert len(events) > 2 and all(event["usage"] is None for event in events[:-1] if "usage" in event)


@pytest.mark.parametrize("endpoint", [completion, chat])
def test_continuous_usage_stats_with_include_usage_put_usage_in_every_chunk(client, endpoint):
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = sse_events(endpoint(client, stream=True, stream_options=options))
    usages = [event["usage"] for event in events[:-1]]
    assert all(usages) and usages[-1]["completion_tokens"] == 4 and not events[-2]["choices"]
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts)
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


def test_the_chat_role_chunk_reports_no_completion_tokens(client):
    """The role chunk is written before any text (vLLM's reports 0); each later chunk here
    carries one token, so its count is the number of text chunks so far."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = sse_events(chat(client, stream=True, n=2, stream_options=options))
    role_chunks = [event for event in events[:-1] if event["choices"] and "role" in event["choices"][0]["delta"]]
    assert len(role_chunks) == 2
    assert all(event["usage"]["completion_tokens"] == 0 for event in role_chunks)
    assert all(event["usage"]["total_tokens"] == event["usage"]["prompt_tokens"] > 0 for event in role_chunks)
    token_chunks = [event for event in events[2:-1] if event["choices"]]
    assert [event["usage"]["completion_tokens"] for event in token_chunks] == list(range(1, 9))


def test_chat_echo_prefixes_the_last_message_of_the_replys_role(client, engine, tokenizer):
    messages = CHAT + [{"role": "assistant", "content": "Sure:"}]
    body = client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 4, "echo": True, "add_generation_prompt": False,
        "continue_final_message": True}).json()
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith("Sure:")
    assert len(message["content"]) > len("Sure:")


def test_best_of_and_beam_search_reach_the_engine(client, engine):
    body = completion(client, n=1, best_of=3).json()
    params = engine.requests[-1][2]
    assert params.n == 3 and params.logprobs == 0 and len(body["choices"]) == 1
    assert body["choices"][0]["logprobs"] is None  # used to rank, not returned
    body = completion(client, n=2, use_beam_search=True, length_penalty=0.5).json()
    params = engine.requests[-1][2]
    assert params.use_beam_search and params.n == 2 and params.length_penalty == 0.5 and len(body["choices"]) == 2


# ---- routes ---------------------------------------------------------------------------------------


def test_model_by_id_tokenizer_info_load_and_tokens_as_strings(client, tokenizer):
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_openai_error(client.get("/v1/models/other"), 404, "NotFoundError")
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["tokenizer_class"]
    assert client.get("/load").json() == {"server_load": 0}
    body = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])


TOOL_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
                 "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tokenize_with_tools_renders_exactly_what_the_template_renders(client, engine, tokenizer):
    """vLLM's /tokenize: tools go to the template, and nothing else is added. The tool prompt a
    template without tool support gets (the tiny tokenizer's) belongs to generation only."""
    def rendered(template_tokenizer, tools):
        text = template_tokenizer.apply_chat_template(CHAT, tools=tools, add_generation_prompt=True, tokenize=False)
        return template_tokenizer.encode(text, add_special_tokens=False)

    tokens = client.post("/tokenize", json={"messages": CHAT, "tools": [WEATHER]}).json()["tokens"]
    assert tokens == rendered(tokenizer, [WEATHER]) == rendered(tokenizer, None)
    assert chat(client, tools=[WEATHER]).status_code == 200  # generation adds the fallback tool prompt
    assert len(engine.requests[-1][1]) > len(tokens)
    tool_tokenizer = copy.deepcopy(tokenizer)
    tool_tokenizer.chat_template = TOOL_TEMPLATE
    info = ModelInfo(MODEL, 2048, TINY_VOCAB, [engine.eos])
    with TestClient(create_app(engine, tool_tokenizer, info)) as tools_client:
        tokens = tools_client.post("/tokenize", json={"messages": CHAT, "tools": [WEATHER]}).json()["tokens"]
        assert tokens == rendered(tool_tokenizer, [WEATHER]) != rendered(tool_tokenizer, None)
        assert "get_weather" in tool_tokenizer.decode(tokens)
        assert tools_client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER],
                                                               "max_tokens": 2}).status_code == 200
        assert engine.requests[-1][1] == tokens  # a template with tool support: the same prompt


def test_invocations_dispatches_by_body(client):
    chat_body = client.post("/invocations", json={"messages": CHAT, "max_tokens": 2}).json()
    assert chat_body["object"] == "chat.completion"
    assert client.post("/invocations", json={"prompt": "Hi", "max_tokens": 2}).json()["object"] == "text_completion"
    assert_openai_error(client.post("/invocations", json={"x": 1}), 400, "BadRequestError")


def test_openapi_schema_is_served_and_true_to_the_request_models(client):
    schema = client.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/models/{model_id}"):
        assert path in schema["paths"]
    chat_fields = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert chat_fields["additionalProperties"] is False and "tools" in chat_fields["properties"]
    assert client.get("/docs").status_code == 200
