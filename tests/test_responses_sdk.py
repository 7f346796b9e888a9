"""The openai SDK's ``responses.create`` and ``responses.stream`` against Tandem's Responses API: a
live server on loopback over the fake engine of tests/fake_engine.py (plain, streamed, a
function-tool round trip, a continuation), then the real stack (a tiny random Llama behind the gRPC
backend), where the chat endpoint's ``stream()`` with required tools is checked too.
"""

from __future__ import annotations

import json

import openai
import pytest
from helpers import LoopThread, tiny_llama_stack, uvicorn_on
from fake_engine import MODEL, FakeEngine, tokenizer, tokenizer_dir  # noqa: F401
from test_responses_api import CALL_TEXT, WEATHER, make_app, say


# ---- the openai SDK against a live server -------------------------------------------------------------


@pytest.fixture
def live(tokenizer):  # noqa: F811
    """uvicorn on loopback over the fake engine; yields (openai client, engine)."""
    engine = FakeEngine(tokenizer)  # noqa: F811
    loop = LoopThread()
    try:
        with uvicorn_on(loop, make_app(engine, tokenizer)) as base_url:
            yield openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30), engine
    finally:
        loop.close()


@pytest.mark.timeout(60)
def test_sdk_create_and_stream(live, tokenizer):  # noqa: F811
    client, engine = live
    say(engine, tokenizer, "Hello from Tandem.")
    response = client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.",
                                       max_output_tokens=50, temperature=0)
    assert response.output_text == "Hello from Tandem." and response.status == "completed"
    assert response.usage.output_tokens == len(tokenizer.encode("Hello from Tandem.", add_special_tokens=False)) + 1
    with client.responses.stream(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=50,
                                 temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == response.output_text and len(deltas) > 1
    assert final.usage.output_tokens == response.usage.output_tokens
    kinds = [event.type for event in client.responses.create(model=MODEL, input="Say hello.", stream=True,
                                                             max_output_tokens=3)]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert client.responses.retrieve(response.id).output_text == response.output_text
    with pytest.raises(openai.BadRequestError, match="reasoning"):
        client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "high"})
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_unknown")


@pytest.mark.timeout(60)
def test_sdk_function_tool_round_trip_and_continuation(live, tokenizer):  # noqa: F811
    client, engine = live
    say(engine, tokenizer, CALL_TEXT)
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                 max_output_tokens=400) as stream:
        first = stream.get_final_response()
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.parsed_arguments == {"city": "Paris"}  # strict: the SDK parsed it

    say(engine, tokenizer, "It is sunny in Paris.")
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                     max_output_tokens=400, input=[{"type": "function_call_output",
                                                                    "call_id": call.call_id, "output": "sunny, 24 C"}])
    assert second.output_text == "It is sunny in Paris." and second.previous_response_id == first.id
    prompt = tokenizer.decode(engine.requests[-1][1])
    assert "What is the weather in Paris?" in prompt and '"city": "Paris"' in prompt and "sunny, 24 C" in prompt

    # The same round trip without the store: the client sends the conversation back.
    say(engine, tokenizer, "Still sunny.")
    third = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=400, store=False, input=[
        {"role": "user", "content": "What is the weather in Paris?"}, *first.output,  # the SDK's idiom
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}])
    assert third.output_text == "Still sunny."
    assert engine.requests[-1][1] == engine.requests[-2][1]  # the same prompt as the stored continuation's
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


# ---- the real stack: a tiny random Llama behind the gRPC backend ------------------------------------------

CITY_TOOL = {"type": "function", "name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "London", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def real_stack(tiny_checkpoint, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-llama-1k")
    with tiny_llama_stack(tiny_checkpoint("llama"), model_dir) as base_url:
        yield openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=240), str(model_dir)


@pytest.mark.timeout(300)
def test_sdk_on_a_real_model(real_stack):
    client, model = real_stack
    ask = "What is the weather in Paris?"
    # Random weights: sampled (greedy can loop on JSON whitespace), and an enum, so whatever is drawn is valid.
    first = client.responses.create(model=model, input=ask, tools=[CITY_TOOL], max_output_tokens=200, temperature=1.0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert first.status == "completed", first
    (call,) = first.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "London", "Rome")
    with client.responses.stream(model=model, input=ask, tools=[CITY_TOOL], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200, temperature=1.0) as stream:
        streamed = stream.get_final_response()
    (streamed_call,) = streamed.output
    assert streamed_call.parsed_arguments["city"] in ("Paris", "London", "Rome")

    second = client.responses.create(model=model, previous_response_id=first.id, tools=[CITY_TOOL],
                                     max_output_tokens=8, temperature=0, input=[
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": "sunny, 24 C"}])
    assert second.status in ("completed", "incomplete") and second.usage.output_tokens <= 8
    assert second.usage.input_tokens > first.usage.input_tokens  # the first exchange came first
    with client.responses.stream(model=model, previous_response_id=first.id, tools=[CITY_TOOL], max_output_tokens=8,
                                 temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                        "output": "sunny, 24 C"}]) as stream:
        # Incomplete at 8 tokens, or completed: the last event carries the response either way.
        (again,) = [event.response for event in stream
                    if event.type in ("response.completed", "response.incomplete")]
    assert again.output_text == second.output_text and again.status == second.status  # greedy: the same reply

    # The chat endpoint's stream() with required tools on real constrained output.
    with client.chat.completions.stream(model=model, messages=[{"role": "user", "content": ask}], max_tokens=200,
                                        temperature=1.0, parallel_tool_calls=False, tool_choice="required", tools=[
                                            {"type": "function", "function": {
                                                "name": "get_weather", "parameters": CITY_TOOL["parameters"]}}]
                                        ) as chat_stream:
        completion = chat_stream.get_final_completion()
    (chat_call,) = completion.choices[0].message.tool_calls
    assert json.loads(chat_call.function.arguments)["city"] in ("Paris", "London", "Rome")
