"""Text that is not valid Unicode (a lone UTF-16 surrogate, which JSON can carry as "\\ud800") in any
text field of any endpoint is a 400 naming the field, never a 500, and the server serves on.

Every field of every request model that can hold text (a string, a list or dict of them, free-form
JSON, a dict's keys, a nested model's text) has a case here; test_every_text_field_has_a_case checks
that against the models themselves, so a field added later without a case fails it.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Union

import pytest
from conftest import TINY_VOCAB, build_tokenizer
from fastapi.testclient import TestClient
from pydantic import BaseModel
from fake_engine import FakeEngine

from backend.types.errors import InvalidRequestError
from backend.types.outputs import ModelInfo
from frontend import protocol as P
from frontend.app import create_app
from frontend.tokenizer import load_tokenizer
from frontend.unicode_check import check_valid_unicode, find_invalid_unicode

BAD = "ok \ud800 there"  # a lone high surrogate
BAD_LOW = "\udc00"  # a lone low surrogate
C, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
ROUTE_MODELS = {C: P.CompletionRequest, CHAT: P.ChatCompletionRequest, TOKENIZE: P.TokenizeRequest,
                DETOKENIZE: P.DetokenizeRequest}
BASE = {C: {"prompt": "Hi", "max_tokens": 2}, CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        TOKENIZE: {"prompt": "Hi"}, DETOKENIZE: {"tokens": [1]}}

# Fields both generation endpoints take (SamplingFields and its Unsupported base): (field, bad value).
SHARED = [
    ("model", BAD), ("stop", BAD), ("stop", ["fine", BAD]), ("user", BAD), ("request_id", BAD),
    ("cache_salt", BAD_LOW), ("bad_words", [BAD]), ("logit_bias", {BAD: 1.0}), ("logits_processors", [BAD]),
    ("kv_transfer_params", {"k": BAD}), ("vllm_xargs", {"k": [1, {"deep": BAD}]}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": BAD, "schema": {"type": "object"}}}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "description": BAD}}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [BAD]}}}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {BAD: {}}}}}),
    ("structured_outputs", {"json": {"type": "string", "pattern": BAD}}),
    ("structured_outputs", {"json": '{"type": "' + BAD + '"}'}),
    ("structured_outputs", {"regex": BAD}), ("structured_outputs", {"choice": ["a", BAD]}),
    ("structured_outputs", {"grammar": BAD}),
    ("guided_json", {"type": "string", "enum": [BAD]}), ("guided_json", '{"type": "' + BAD + '"}'),
    ("guided_regex", BAD), ("guided_choice", ["a", BAD]), ("guided_grammar", BAD),
    ("guided_decoding_backend", BAD), ("guided_whitespace_pattern", BAD),
]
CASES = [(route, field, value) for route in (C, CHAT) for field, value in SHARED] + [
    (C, "prompt", BAD), (C, "prompt", BAD_LOW), (C, "prompt", ["fine", BAD]), (C, "suffix", BAD),
    (C, "prompt_embeds", BAD),
    (CHAT, "messages", [{"role": "user", "content": BAD}]),
    (CHAT, "messages", [{"role": "user", "content": [{"type": "text", "text": BAD}]}]),
    (CHAT, "messages", [{"role": "user", "content": "Hi", "name": BAD}]),
    (CHAT, "messages", [{"role": BAD, "content": "Hi"}]),
    (CHAT, "messages", [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "' + BAD + '"}'}}]}]),
    (CHAT, "messages", [{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": BAD, "content": "1"}]),
    (CHAT, "messages", [{"role": "user", "content": "Hi", BAD: "a key"}]),
    (CHAT, "tools", [{"type": "function", "function": {"name": "f", "description": BAD, "parameters": {}}}]),
    (CHAT, "tools", [{"type": "function", "function": {"name": "f", "parameters": {"properties": {BAD: {}}}}}]),
    (CHAT, "tool_choice", {"type": "function", "function": {"name": BAD}}),
    (CHAT, "chat_template", "{{ '" + BAD + "' }}"), (CHAT, "chat_template_kwargs", {"k": BAD}),
    (CHAT, "chat_template_kwargs", {BAD: 1}), (CHAT, "reasoning_effort", BAD), (CHAT, "documents", [{"text": BAD}]),
    (CHAT, "mm_processor_kwargs", {"k": BAD}), (CHAT, "functions", [{"name": BAD}]), (CHAT, "function_call", BAD),
    (CHAT, "audio", {"voice": BAD}), (CHAT, "modalities", [BAD]), (CHAT, "prediction", {"content": BAD}),
    (CHAT, "web_search_options", {"k": BAD}),
    (TOKENIZE, "prompt", BAD), (TOKENIZE, "model", BAD),
    (TOKENIZE, "messages", [{"role": "user", "content": [{"type": "text", "text": BAD}]}]),
    (TOKENIZE, "chat_template", BAD), (TOKENIZE, "chat_template_kwargs", {"k": [BAD]}),
    (TOKENIZE, "tools", [{"type": "function", "function": {"name": BAD}}]),
    (DETOKENIZE, "model", BAD),
]


def body_of(route: str, field: str, value: Any) -> str:
    body = dict(BASE[route])
    if route == TOKENIZE and field in ("messages", "tools", "chat_template", "chat_template_kwargs"):
        body = {"messages": [{"role": "user", "content": "Hi"}]}
    body[field] = value
    return json.dumps(body)  # ensure_ascii: a lone surrogate is written as its \\u escape, as a client would


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    tokenizer = load_tokenizer(str(directory))
    engine = FakeEngine(tokenizer)
    with TestClient(create_app(engine, tokenizer, ModelInfo("m", 128, TINY_VOCAB, [engine.eos])),
                    raise_server_exceptions=False) as test_client:
        yield test_client


def post(client: TestClient, route: str, body: Union[str, bytes]):
    return client.post(route, content=body, headers={"content-type": "application/json"})


def assert_serving(client: TestClient) -> None:
    for route in ROUTE_MODELS:
        response = post(client, route, json.dumps(BASE[route]))
        assert response.status_code == 200, (route, response.text)


@pytest.mark.parametrize("route, field, value", CASES,
                         ids=[f"{i}-{route.strip('/').replace('/', '_')}-{field}" for i, (route, field, _) in
                              enumerate(CASES)])
def test_invalid_unicode_in_a_text_field_is_a_400_naming_it(client, route, field, value):
    response = post(client, route, body_of(route, field, value))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field, error
    if field != "tool_choice" or isinstance(value, dict):
        assert "not valid Unicode" in error["message"] and "U+D" in error["message"], error
    assert_serving(client)


@pytest.mark.parametrize("route, body", [
    ("/invocations", json.dumps({"prompt": BAD})),
    ("/invocations", json.dumps({"messages": [{"role": "user", "content": BAD}]})),
    (C, b'{"prompt": "Hi \xed\xa0\x80"}'),  # a surrogate as raw UTF-8 bytes (CESU-style), not an escape
])
def test_every_route_and_encoding_of_a_surrogate_is_refused(client, route, body):
    response = post(client, route, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("prompt", "messages")
    assert_serving(client)


def test_a_surrogate_in_a_json_key_never_becomes_a_500(client):
    for body in ('{"prompt": "Hi", "\\ud800": 1}', '{"prompt": "Hi", "logit_bias": {"\\ud800": "x"}}'):
        response = post(client, C, body)
        assert response.status_code == 400, response.text
        response.json()  # the error itself is valid UTF-8 JSON
    assert_serving(client)


def test_paired_surrogates_are_valid_text(client):
    response = post(client, C, json.dumps({"prompt": "smile 😀", "max_tokens": 2, "stop": ["😀"]}))
    assert response.status_code == 200, response.text
    assert json.loads(post(client, TOKENIZE, json.dumps({"prompt": "😀"})).text)["count"] > 0


# ---- completeness: every text-capable field has a case -------------------------------------------------


def _can_hold_text(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if annotation is str or annotation is Any:
        return True
    if origin is typing.Literal:
        return False  # only the values listed; anything else is refused by the model
    if origin is typing.Annotated:
        return _can_hold_text(typing.get_args(annotation)[0])
    if origin is dict:
        return True  # its keys are text
    if origin in (list, tuple, Union, types.UnionType):
        return any(_can_hold_text(arg) for arg in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return any(_can_hold_text(f.annotation) for f in annotation.model_fields.values())
    return False


def test_every_text_field_has_a_case():
    covered = {(route, field) for route, field, _ in CASES}
    for route, model in ROUTE_MODELS.items():
        for name, field in model.model_fields.items():
            if _can_hold_text(field.annotation):
                assert (route, field.alias or name) in covered, f"no invalid-Unicode case for {route} {name}"


# ---- the checker itself ------------------------------------------------------------------------------


def test_the_checker_names_the_path_and_the_character():
    value = [{"role": "user", "content": [{"type": "text", "text": "fine"}, {"type": "text", "text": "ab\udfff"}]}]
    assert find_invalid_unicode(value) == ("[0].content[1].text", 2, "U+DFFF")
    assert find_invalid_unicode({"a": [1, 2.5, None, True, "x"], "b": {"c": "é😀"}}) is None
    assert find_invalid_unicode({"ok": 1, "\ud800": 2})[0] == " (a key)"
    assert find_invalid_unicode(list(range(100_000)) + ["\ud800"])[0] == "[100000]"
    with pytest.raises(InvalidRequestError) as error:
        check_valid_unicode({"x": "\ud800"}, "field")
    assert error.value.param == "field" and "field.x" in str(error.value)
    deep: Any = "\ud800"
    for _ in range(10_000):  # no recursion limit
        deep = [deep]
    assert find_invalid_unicode(deep) is not None

