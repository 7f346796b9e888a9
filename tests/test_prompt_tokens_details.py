"""``usage.prompt_tokens_details`` (the prompt tokens the prefix cache served) only with
``--enable-prompt-tokens-details``, as vLLM: chat and completions, streamed usage too; the key is
left out (not null) without the flag. /v1/responses and /v1/messages report theirs always (their
schemas' own fields). Against the fake engine of tests/fake_engine.py, which reports 3 cached
prompt tokens for every request."""

from __future__ import annotations

import pytest
from fake_engine import MODEL, engine, make_client, sse_events, tokenizer, tokenizer_dir  # noqa: F401

from frontend import server
from frontend.entrypoints import cli

CACHED = 3  # the fake engine's num_cached_tokens
STREAM_USAGE = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
ROUTES = {"/v1/completions": {"prompt": "Hello there"},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello there"}]}}


def usages(client, route: str, stream: bool) -> list[dict]:
    """Every usage object of one reply (each chunk's when streamed with continuous usage)."""
    body = {"model": MODEL, "max_tokens": 3, **ROUTES[route], **(STREAM_USAGE if stream else {})}
    response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    if not stream:
        return [response.json()["usage"]]
    found = [event["usage"] for event in sse_events(response) if isinstance(event, dict) and "usage" in event]
    assert len(found) >= 2  # continuous usage chunks, then the final usage chunk
    return found


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", list(ROUTES))
def test_the_flag_adds_cached_tokens_and_without_it_the_key_is_absent(engine, tokenizer, route, stream):  # noqa: F811
    with make_client(engine, tokenizer) as client:
        for usage in usages(client, route, stream):
            assert "prompt_tokens_details" not in usage, usage  # absent, not null
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    with make_client(engine, tokenizer, enable_prompt_tokens_details=True) as client:
        for usage in usages(client, route, stream):
            assert usage["prompt_tokens_details"] == {"cached_tokens": CACHED}, usage


def test_responses_and_messages_report_cached_tokens_without_the_flag(engine, tokenizer):  # noqa: F811
    with make_client(engine, tokenizer) as client:
        reply = client.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 3})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["input_tokens_details"] == {"cached_tokens": CACHED}
        streamed = client.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 3,
                                                      "stream": True})
        assert f'"input_tokens_details":{{"cached_tokens":{CACHED}}}' in streamed.text
        message = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 3,
                                                     "messages": [{"role": "user", "content": "Hello"}]})
        assert message.status_code == 200, message.text
        usage = message.json()["usage"]
        assert usage["cache_read_input_tokens"] == CACHED and usage["input_tokens"] >= 1


def test_the_flag_is_vllms_name_on_the_frontend_and_serve():
    assert server.build_parser().parse_args(["--backend", "x"]).enable_prompt_tokens_details is False
    assert server.build_parser().parse_args(["--backend", "x", "--enable-prompt-tokens-details"]) \
        .enable_prompt_tokens_details is True
    plain = cli.build_parser().parse_args(["serve"])
    flagged = cli.build_parser().parse_args(["serve", "--enable-prompt-tokens-details"])
    assert "--enable-prompt-tokens-details" not in cli.frontend_options(plain)
    passed_on = cli.frontend_options(flagged)
    assert "--enable-prompt-tokens-details" in passed_on
    # What serve passes on, the frontend's parser takes.
    assert server.build_parser().parse_args(["--backend", "x", *passed_on]).enable_prompt_tokens_details is True
