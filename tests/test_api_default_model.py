"""Acceptance (issue 28): the clients' APIs against one `tandem serve` of the real default model.

SmolLM2-135M-Instruct, fp32, served as tests/test_cli_serve.py serves (``start_serve``), with a
context long enough for the tools' fallback system prompt. Through the SDKs users run: openai's
embeddings (equal to HF's pooled hidden states), Responses (plain, streamed, a tool round trip,
``previous_response_id``), ``logit_bias``, ``chat.completions.stream()`` with named, required and
auto tools, JSON mode; anthropic's ``messages.create`` / ``messages.stream`` with a tool round trip.

Replies are greedy (``temperature`` 0), so a streamed reply must equal the same request unstreamed,
and each API must agree with the chat endpoint it is built on. Every generation is bounded by
``max_tokens``, every test by a timeout.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import numpy as np
import openai
import pytest
import torch
from test_cli_serve import Served, start_serve, stop, wait_until_serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MAX_MODEL_LEN = 2048  # the tools' fallback system prompt and a few turns
HIDDEN_SIZE = 576  # SmolLM2-135M
GREEDY = {"temperature": 0}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
               "additionalProperties": False}
TIME_SCHEMA = {"type": "object", "properties": {"timezone": {"enum": ["UTC", "CET", "EST"]}},
               "required": ["timezone"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                                 "parameters": CITY_SCHEMA, "strict": True}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a timezone",
                                              "parameters": TIME_SCHEMA}}
SCHEMAS = {"get_weather": CITY_SCHEMA, "get_time": TIME_SCHEMA}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(default_model_dir, tmp_path_factory) -> Served:
    process, log, port, grpc_port, metrics_port = start_serve(
        default_model_dir, tmp_path_factory.mktemp("default-model-serve"),
        "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "512")  # after ENGINE_FLAGS: these win
    try:
        wait_until_serving(process, log)
        yield Served(process, log, port, grpc_port, metrics_port, str(default_model_dir))
    finally:
        stop(process)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model(served) -> str:
    return served.model


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def only_token(hf_tokenizer, text: str) -> int:
    (token_id,) = hf_tokenizer.encode(text, add_special_tokens=False)
    return token_id


def assert_calls_valid(calls) -> None:
    """Every call names an offered tool and its arguments parse and hold to that tool's schema."""
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---- embeddings ----------------------------------------------------------------------------------


def test_sdk_embeddings_equal_hf_pooled_hidden_states(client, model, default_model_dir, hf_tokenizer):
    """README: the final hidden states (after the final norm), the last token's by default, unit length;
    ``"pooling_type": "mean"`` and ``"normalize": false`` on request. fp32 on both sides, within 1e-3."""
    from transformers import AutoModel

    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "hello"]
    hf = AutoModel.from_pretrained(str(default_model_dir), torch_dtype=torch.float32).eval()
    token_ids = [hf_tokenizer(text)["input_ids"] for text in texts]

    def pooled(ids: list[int], kind: str = "last", normalize: bool = True) -> np.ndarray:
        with torch.no_grad():
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]  # [len, hidden]
        vector = hidden[-1] if kind == "last" else hidden.mean(0)
        return (torch.nn.functional.normalize(vector, dim=0) if normalize else vector).numpy()

    response = client.embeddings.create(model=model, input=texts)  # the SDK asks for base64 and decodes it
    assert [item.index for item in response.data] == [0, 1, 2]
    for ids, item in zip(token_ids, response.data):
        assert len(item.embedding) == HIDDEN_SIZE
        np.testing.assert_allclose(item.embedding, pooled(ids), atol=1e-3, rtol=0)
    assert response.usage.prompt_tokens == sum(map(len, token_ids))
    # Different texts, different vectors (a constant answer would fail here, not only above).
    assert np.dot(response.data[0].embedding, response.data[2].embedding) < 0.999

    by_ids = client.embeddings.create(model=model, input=token_ids[1], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, response.data[1].embedding, atol=1e-5, rtol=0)
    mean = client.embeddings.create(model=model, input=texts[0], encoding_format="float",
                                    extra_body={"pooling_type": "mean", "normalize": False})
    np.testing.assert_allclose(mean.data[0].embedding, pooled(token_ids[0], "mean", False), atol=1e-3, rtol=0)


# ---- the Responses API ----------------------------------------------------------------------------


def test_responses_plain_and_streamed_equal_the_chat_reply(client, model):
    instructions, question = "Answer in one sentence.", "What is the capital of France?"
    chat = client.chat.completions.create(model=model, max_tokens=24, messages=[
        {"role": "system", "content": instructions}, {"role": "user", "content": question}], **GREEDY)
    response = client.responses.create(model=model, input=question, instructions=instructions,
                                       max_output_tokens=24, **GREEDY)
    assert response.output_text and response.output_text == chat.choices[0].message.content  # the same prompt
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens

    with client.responses.stream(model=model, input=question, instructions=instructions, max_output_tokens=24,
                                 **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{response.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == response.output_text


def test_responses_tool_round_trip_and_previous_response_id(client, model):
    tool = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
            "parameters": CITY_SCHEMA, "strict": True}
    first = client.responses.create(model=model, input="What is the weather in Paris?", tools=[tool],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=60, **GREEDY)
    assert first.status == "completed", first
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY_SCHEMA)
    assert "paris" in json.loads(call.arguments)["city"].lower()  # the question reached the model

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}
    second = client.responses.create(model=model, previous_response_id=first.id, input=[result], tools=[tool],
                                     max_output_tokens=16, **GREEDY)
    assert second.previous_response_id == first.id and second.output_text
    # The continuation is the conversation sent back in full, without the store: the same prompt, the same reply.
    explicit = client.responses.create(model=model, store=False, tools=[tool], max_output_tokens=16, **GREEDY, input=[
        {"role": "user", "content": "What is the weather in Paris?"}, *first.output, result])
    assert explicit.usage.input_tokens == second.usage.input_tokens > first.usage.input_tokens
    assert explicit.output_text == second.output_text

    # A plain text continuation, streamed, after the tool's exchange. Cut at 12 tokens or not, the last event
    # carries the response (the SDK's get_final_response() wants "completed" only).
    with client.responses.stream(model=model, previous_response_id=second.id, input="And tomorrow?",
                                 tools=[tool], tool_choice="none", max_output_tokens=12, **GREEDY) as stream:
        *_, last = stream
    assert last.type in ("response.completed", "response.incomplete")
    third = last.response
    assert third.previous_response_id == second.id and third.output_text
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert client.responses.retrieve(third.id).output_text == third.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="Hi", previous_response_id=explicit.id)  # store=False kept nothing


# ---- Anthropic's Messages API ---------------------------------------------------------------------


def test_anthropic_sdk_create_and_stream_with_a_tool_round_trip(served, model):
    client = anthropic.Anthropic(base_url=served.base_url, api_key="unused", max_retries=0, timeout=180)
    tools = [{"name": "get_weather", "description": "Get the current weather in a city", "input_schema": CITY_SCHEMA}]
    named = {"type": "tool", "name": "get_weather"}
    first = client.messages.create(model=model, max_tokens=60, system="You are a weather assistant.",
                                   messages=ASK_WEATHER, tools=tools, tool_choice=named, extra_body=GREEDY)
    assert first.stop_reason == "tool_use", first
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, CITY_SCHEMA)
    with client.messages.stream(model=model, max_tokens=60, system="You are a weather assistant.",
                                messages=ASK_WEATHER, tools=tools, tool_choice=named, extra_body=GREEDY) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_delta" in events
    assert streamed.stop_reason == "tool_use" and streamed.content[0].input == call.input

    follow_up = ASK_WEATHER + [{"role": "assistant", "content": first.content}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 24 C"}]}]
    reply = client.messages.create(model=model, max_tokens=16, system="You are a weather assistant.",
                                   messages=follow_up, tools=tools, extra_body=GREEDY)
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content[0].type == "text"
    with client.messages.stream(model=model, max_tokens=16, system="You are a weather assistant.",
                                messages=follow_up, tools=tools, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reply.content[0].text and final.stop_reason == reply.stop_reason
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > first.usage.input_tokens
    counted = client.messages.count_tokens(model=model, system="You are a weather assistant.", messages=follow_up,
                                           tools=tools).input_tokens
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


# ---- logit_bias -----------------------------------------------------------------------------------


def test_logit_bias_forces_and_forbids_tokens(client, model, hf_tokenizer):
    paris, london = only_token(hf_tokenizer, " Paris"), only_token(hf_tokenizer, " London")
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=1, logprobs=1, **GREEDY)
    assert plain.choices[0].text == " Paris"  # the greedy answer the bias must change
    forbidden = client.completions.create(model=model, prompt=prompt, max_tokens=6, logprobs=1,
                                          logit_bias={str(paris): -100}, **GREEDY)
    tokens = forbidden.choices[0].logprobs.tokens
    assert len(tokens) == 6 and " Paris" not in tokens and tokens[0] != " Paris"

    # +100 outweighs any logit: every token is the forced one, greedy or sampled, on the chat endpoint too.
    for sampling in (GREEDY, {"temperature": 1.0, "seed": 3}):
        forced = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=5, logit_bias={str(london): 100}, **sampling)
        assert forced.choices[0].message.content == " London" * 5, forced
    zero_bias = client.completions.create(model=model, prompt=prompt, max_tokens=1, logit_bias={str(london): 0},
                                          **GREEDY)
    assert zero_bias.choices[0].text == " Paris"  # a zero bias changes nothing
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=model, prompt=prompt, max_tokens=1, logit_bias={str(paris): 101})


# ---- chat.completions.stream() with tools ---------------------------------------------------------


def stream_with_tools(client, model, messages, **request):
    """The SDK's stream(): its final completion and each chunk's tool-call entries."""
    tool_chunks = []
    with client.chat.completions.stream(model=model, messages=messages, **request) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices and event.chunk.choices[0].delta.tool_calls:
                tool_chunks.append(event.chunk.choices[0].delta.tool_calls)
        final = stream.get_final_completion()
    for entries in tool_chunks:  # never two entries for one call in a chunk (the SDK would drop one)
        assert len({entry.index for entry in entries}) == len(entries)
    return final, tool_chunks


def test_sdk_stream_with_a_named_tool(client, model):
    request = dict(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   max_tokens=60, **GREEDY)
    final, tool_chunks = stream_with_tools(client, model, ASK_WEATHER, **request)
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and final.choices[0].finish_reason == "stop"
    assert_calls_valid([call])
    assert call.function.parsed_arguments == json.loads(call.function.arguments)  # strict: the SDK parsed it whole
    assert len(tool_chunks) > 1  # the arguments streamed, piece by piece
    whole = client.chat.completions.create(model=model, messages=ASK_WEATHER, **request)
    assert whole.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


def test_sdk_stream_with_required_tools(client, model):
    request = dict(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", max_tokens=120, **GREEDY)
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]
    final, tool_chunks = stream_with_tools(client, model, messages, **request)
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and not final.choices[0].message.content
    assert_calls_valid(calls)
    assert len({call.id for call in calls}) == len(calls)
    assert len(tool_chunks) > len(calls)  # streamed as generated, not one chunk at the end
    whole = client.chat.completions.create(model=model, messages=messages, **request)
    assert whole.choices[0].message.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in calls]


def test_sdk_stream_with_auto_tools(client, model):
    """With ``auto`` the reply is parsed, not constrained: two earlier calls in the conversation show the
    small model the fallback prompt's format, and it calls the tool for the third city."""
    def earlier_call(number: int, city: str) -> list[dict]:
        call_id = f"call_{number}"
        return [{"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "rainy"}]

    messages = earlier_call(1, "London") + earlier_call(2, "Berlin") + ASK_WEATHER
    request = dict(tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=60, **GREEDY)
    final, tool_chunks = stream_with_tools(client, model, messages, **request)
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls", final
    assert [c.function.name for c in calls] == ["get_weather"] and tool_chunks
    assert_calls_valid(calls)
    assert "paris" in calls[0].function.parsed_arguments["city"].lower()
    whole = client.chat.completions.create(model=model, messages=messages, **request)
    assert [c.function.arguments for c in whole.choices[0].message.tool_calls] == [calls[0].function.arguments]


# ---- JSON mode ------------------------------------------------------------------------------------


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}}},
], ids=["json_object", "json_schema"])
def test_json_mode_finishes_with_valid_json_within_200_tokens(client, model, response_format):
    """Bounded whitespace (``--json-max-whitespace``): greedy JSON from a small model ends, not in newlines."""
    reply = client.chat.completions.create(model=model, max_tokens=200, response_format=response_format, messages=[
        {"role": "user", "content": "Return a JSON object with the keys name and age for Alice, who is 30."}],
        **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    value = json.loads(choice.message.content)
    assert isinstance(value, dict)
    if response_format["type"] == "json_schema":
        jsonschema.validate(value, response_format["json_schema"]["schema"])
