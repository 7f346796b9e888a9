"""vLLM's legacy guided_* fields as aliases of structured_outputs (frontend/serving/guided.py), fake engine."""

from __future__ import annotations

import json
import logging

import pytest
from fake_engine import MODEL, assert_openai_error, engine, sse_events, tokenizer, tokenizer_dir  # noqa: F401
from test_openai_extensions import SCHEMA, chat, client, completion  # noqa: F401

from frontend.protocol import UNSUPPORTED_FIELDS


def constraint(engine):  # noqa: F811
    return engine.requests[-1][2].structured_outputs


@pytest.mark.parametrize("send", [chat, completion])
def test_each_guided_field_becomes_its_structured_outputs_entry_with_a_deprecation_header(client, engine, send):
    response = send(client, guided_json=SCHEMA)
    assert response.status_code == 200 and response.headers["Deprecation"] == "true"
    assert json.loads(constraint(engine).json) == SCHEMA
    assert send(client, guided_json=json.dumps(SCHEMA)).status_code == 200  # the schema as JSON text
    assert json.loads(constraint(engine).json) == SCHEMA
    assert send(client, guided_regex="[0-9]+").status_code == 200
    assert constraint(engine).regex == "[0-9]+"
    assert send(client, guided_choice=["yes", "no"]).status_code == 200
    assert constraint(engine).choice == ["yes", "no"]
    assert send(client, guided_grammar='root ::= "a"').status_code == 200
    assert constraint(engine).grammar == 'root ::= "a"'
    plain = send(client, structured_outputs={"regex": "a"})
    assert plain.status_code == 200 and "Deprecation" not in plain.headers


def test_the_header_comes_on_streams_and_on_invocations(client, engine):
    streamed = chat(client, guided_choice=["yes"], stream=True)
    assert streamed.status_code == 200 and streamed.headers["Deprecation"] == "true"
    assert sse_events(streamed)[-1] == "[DONE]"
    invoked = client.post("/invocations", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                "guided_regex": "b"})
    assert invoked.status_code == 200 and invoked.headers["Deprecation"] == "true"
    assert constraint(engine).regex == "b"


def test_a_warning_is_logged_once_per_field(client, caplog):
    import frontend.serving.guided as guided

    guided._warned.discard("guided_regex")
    with caplog.at_level(logging.WARNING, logger="frontend.serving.guided"):
        completion(client, guided_regex="a")
        completion(client, guided_regex="a")
    warnings = [r for r in caplog.records if "guided_regex" in r.getMessage()]
    assert len(warnings) == 1 and "structured_outputs" in warnings[0].getMessage()


@pytest.mark.parametrize("body, param, named", [
    ({"guided_json": SCHEMA, "structured_outputs": {"regex": "a"}}, "guided_json", ["guided_json", "structured_outputs"]),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     ["guided_regex", "response_format"]),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", ["guided_regex", "guided_choice"]),
])
def test_two_constraints_at_once_are_a_400_naming_both(client, body, param, named):
    for send in (chat, completion):
        error = assert_openai_error(send(client, **body), 400, "BadRequestError", param)
        assert all(name in error["message"] for name in named), error["message"]


def test_errors_name_the_legacy_field(client):
    error = assert_openai_error(chat(client, guided_json="{not json"), 400, "BadRequestError", "guided_json")
    assert "guided_json is not valid JSON" in error["message"]
    assert_openai_error(completion(client, guided_choice=[]), 400, "BadRequestError", "guided_choice")
    assert_openai_error(completion(client, guided_regex=""), 400, "BadRequestError", "guided_regex")


def test_guided_decoding_backend(client, engine):
    for backend in ("xgrammar", "auto"):
        assert completion(client, guided_regex="a", guided_decoding_backend=backend).status_code == 200
    response = completion(client, guided_decoding_backend="xgrammar")  # naming the backend alone is harmless
    assert response.status_code == 200 and response.headers["Deprecation"] == "true"
    assert constraint(engine) is None
    assert completion(client, guided_json=SCHEMA,
                      guided_decoding_backend="xgrammar:disable-any-whitespace, no-fallback").status_code == 200
    assert (constraint(engine).disable_any_whitespace, constraint(engine).disable_fallback) == (True, True)
    for bad in ("outlines", "guidance:no-fallback", "xgrammar:whitespace", ""):
        error = assert_openai_error(completion(client, guided_regex="a", guided_decoding_backend=bad), 400,
                                    "BadRequestError", "guided_decoding_backend")
        assert "xgrammar" in error["message"] or "whitespace" in error["message"], bad
    assert_openai_error(completion(client, guided_decoding_backend="xgrammar:no-fallback"), 400,
                        "BadRequestError", "guided_decoding_backend")


def test_guided_whitespace_pattern_is_refused_naming_it(client):
    assert "guided_whitespace_pattern" in UNSUPPORTED_FIELDS
    assert_openai_error(chat(client, guided_json=SCHEMA, guided_whitespace_pattern=" "), 400, "BadRequestError",
                        "guided_whitespace_pattern")


def test_named_tool_choice_refuses_a_guided_constraint(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert_openai_error(chat(client, tools=[tool], tool_choice="required", guided_regex="a"), 400,
                        "BadRequestError", "tool_choice")
