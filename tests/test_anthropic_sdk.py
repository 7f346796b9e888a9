"""The ``anthropic`` SDK from PyPI against Tandem's Messages API: a live server on loopback over the
fake engine of tests/fake_engine.py (create, stream, count_tokens, a tool round trip, a client
leaving mid-stream), then the real stack (a tiny random Llama behind the gRPC backend): a tool round
trip, created and streamed, whose call the constraint makes valid.
"""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest
from helpers import LoopThread, tiny_llama_stack, uvicorn_on, wait_for
from test_anthropic_messages import CALL_TEXT, CITY_TOOL, USER, WEATHER, body, make_app, say
from fake_engine import MODEL, FakeEngine, tokenizer, tokenizer_dir  # noqa: F401


# ---- the anthropic SDK against a live server ------------------------------------------------------


@pytest.fixture
def live(tokenizer):
    """uvicorn on loopback over the fake engine (on the server's loop); yields (base URL, engine)."""
    engine = FakeEngine(tokenizer)
    loop = LoopThread()
    try:
        with uvicorn_on(loop, make_app(engine, tokenizer)) as base_url:
            yield base_url, engine
    finally:
        loop.close()


def sdk(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


@pytest.mark.timeout(60)
def test_sdk_create_stream_and_count_tokens(live, tokenizer):
    base_url, engine = live
    client = sdk(base_url)
    message = client.messages.create(model=MODEL, max_tokens=8, system="Be brief.", messages=USER,
                                     extra_body={"temperature": 0})
    assert message.stop_reason == "max_tokens" and message.content[0].type == "text" and message.content[0].text
    with client.messages.stream(model=MODEL, max_tokens=8, system="Be brief.", messages=USER,
                                extra_body={"temperature": 0}) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == message.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert final.usage.input_tokens == message.usage.input_tokens
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=USER).input_tokens
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens

    stopped = client.messages.create(model=MODEL, max_tokens=50, messages=USER, stop_sequences=["France"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "France"
    assert stopped.content[0].text == "The capital of "

    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(model=MODEL, max_tokens=8, messages=USER,
                               extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}})
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4", max_tokens=8, messages=USER)


@pytest.mark.timeout(60)
def test_sdk_tool_round_trip(live, tokenizer):
    base_url, engine = live
    client = sdk(base_url)
    say(engine, tokenizer, CALL_TEXT)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.messages.stream(model=MODEL, max_tokens=400, messages=ask, tools=[WEATHER]) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}

    say(engine, tokenizer, "It is sunny in Paris.")
    follow_up = ask + [{"role": "assistant", "content": first.content},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                     "content": "sunny, 24 C"}]}]
    reply = client.messages.create(model=MODEL, max_tokens=400, messages=follow_up, tools=[WEATHER])
    assert reply.stop_reason == "end_turn" and reply.content[0].text == "It is sunny in Paris."
    prompt = tokenizer.decode(engine.requests[-1][1])
    assert "sunny, 24 C" in prompt and '"city": "Paris"' in prompt  # the call and its result were rendered


@pytest.mark.timeout(60)
def test_a_client_leaving_mid_stream_aborts_the_engine_request(tokenizer):
    engine = FakeEngine(tokenizer, delay=0.2)
    loop = LoopThread()
    try:
        with uvicorn_on(loop, make_app(engine, tokenizer)) as base_url, httpx.Client(base_url=base_url, timeout=10) as http:
            request = body(max_tokens=100, stream=True)
            with http.stream("POST", "/v1/messages", json=request) as response:
                assert response.status_code == 200
                assert next(line for line in response.iter_lines() if "content_block_delta" in line)
            # Leaving the block closed the connection with ~15 s of tokens to go.
            assert wait_for(lambda: len(engine.closed_early) == 1), "the engine stream was not closed"
            assert engine.finished == []
    finally:
        loop.close()


# ---- the real stack: a tiny random Llama behind the gRPC backend ------------------------------------


@pytest.fixture(scope="module")
def real_stack(tiny_checkpoint, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-llama-1k")
    with tiny_llama_stack(tiny_checkpoint("llama"), model_dir) as base_url:
        yield base_url, str(model_dir)


@pytest.mark.timeout(300)
def test_sdk_tool_round_trip_on_a_real_model(real_stack):
    base_url, model = real_stack
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=240)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "tool", "name": "get_weather"}
    # Random weights: sampled (greedy can loop on JSON whitespace), and an enum, so whatever is drawn is valid.
    sampled = {"temperature": 1.0}
    tools = [CITY_TOOL]
    first = client.messages.create(model=model, max_tokens=200, messages=ask, tools=tools, tool_choice=choice,
                                   extra_body=sampled)
    assert first.stop_reason == "tool_use", first
    (call,) = first.content
    jsonschema.validate(call.input, CITY_TOOL["input_schema"])
    with client.messages.stream(model=model, max_tokens=200, messages=ask, tools=tools, tool_choice=choice,
                                extra_body=sampled) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[0].type == "tool_use"
    jsonschema.validate(streamed.content[0].input, CITY_TOOL["input_schema"])

    follow_up = ask + [{"role": "assistant", "content": first.content},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                     "content": "sunny, 24 C"}]}]
    reply = client.messages.create(model=model, max_tokens=8, messages=follow_up, tools=tools,
                                   extra_body={"temperature": 0})
    assert reply.stop_reason in ("max_tokens", "end_turn") and reply.content[0].type == "text"
    assert reply.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model=model, messages=follow_up, tools=tools).input_tokens
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
