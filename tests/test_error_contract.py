"""The error contract over both APIs, on the real stack: bad requests get the right 4xx or gRPC
status (OpenAI error JSON on HTTP, never a 5xx or UNKNOWN), and the server serves a valid request
after each one, its engine alive.

One backend (a tiny random Llama, in process, on loopback) and one HTTP frontend over it via
GrpcEngineClient run for the whole module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import LoopThread, backend_and_frontend

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.types.config import EngineConfig
from backend.types.limits import Limits
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

MAX_MODEL_LEN = 64
VOCAB = 384
LIMITS = Limits(max_request_body_bytes=1024 * 1024)  # smaller than the default, so a test body is cheap


@dataclass
class Stack:
    engine: AsyncLLMEngine
    base_url: str
    http: httpx.Client
    channel: grpc.Channel
    stub: engine_pb2_grpc.EngineServiceStub


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    loop = LoopThread()
    engine = AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=4,
                                         max_model_len=MAX_MODEL_LEN, max_num_seqs=4), LIMITS)
    try:
        with backend_and_frontend(loop, engine, LIMITS) as (_, address, base_url), \
                httpx.Client(base_url=base_url, timeout=30) as http, grpc.insecure_channel(address) as channel:
            yield Stack(engine, base_url, http, channel, engine_pb2_grpc.EngineServiceStub(channel))
    finally:
        engine.shutdown()
        loop.close()


def assert_serving(stack: Stack) -> None:
    """A valid request still gets its answer, over both APIs, and the engine is alive."""
    response = stack.http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    final = list(stack.stub.Generate(engine_pb2.GenerateRequest(
        request_id="ok-after", prompt_token_ids=[1, 2], sampling_params=engine_pb2.SamplingParams(max_tokens=1)),
        timeout=30))[-1]
    assert final.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert stack.engine.dead_error is None


# ---- HTTP: (route, body, status, param) -----------------------------------------------------------

C, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
EMBED = "/v1/embeddings"
MESSAGES = [{"role": "user", "content": "Hi"}]


def raw(text: str) -> bytes:
    """A JSON body written by hand (NaN and infinities are not JSON, but Python's parser takes them)."""
    return text.encode()


HTTP_CASES = [
    # n and the number of sequences
    (C, {"prompt": "Hi", "n": 20_000_000}, 400, "n"),
    (CHAT, {"messages": MESSAGES, "n": 20_000_000}, 400, "n"),
    (C, {"prompt": "Hi", "n": 129}, 400, "n"),
    (C, {"prompt": "Hi", "n": 0}, 400, "n"),
    (C, {"prompt": ["Hi"] * 10_000}, 400, "prompt"),
    (C, {"prompt": ["Hi"] * 600, "n": 2}, 400, "n"),
    (C, {"prompt": [[1, 2]] * 1025}, 400, "prompt"),
    # sizes
    (C, {"prompt": "x" * (2 * 1024 * 1024)}, 413, None),
    (C, {"prompt": "Hello " * 20_000}, 400, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "Hello " * 20_000}]}, 400, "messages"),
    ("/tokenize", {"prompt": "Hello " * 20_000}, 400, "prompt"),
    (C, {"prompt": "Hi", "stop": ["a"] * 65}, 400, "stop"),
    (C, {"prompt": "Hi", "stop": "a" * 1025}, 400, "stop"),
    (C, {"prompt": "Hi", "stop_token_ids": list(range(65))}, 400, "stop_token_ids"),
    (C, {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),  # the request's field
    (C, {"prompt": "Hi", "cache_salt": "s" * 257}, 400, "cache_salt"),
    (C, {"prompt": "Hi", "cache_salt": ""}, 400, "cache_salt"),
    (C, {"prompt": [1] * MAX_MODEL_LEN}, 400, "prompt"),
    (C, {"prompt": "Hi", "max_tokens": 10_000}, 400, "max_tokens"),
    # numbers that are not finite
    (C, raw('{"prompt": "Hi", "temperature": NaN}'), 400, "temperature"),
    (C, raw('{"prompt": "Hi", "temperature": Infinity}'), 400, "temperature"),
    (C, raw('{"prompt": "Hi", "top_p": NaN}'), 400, "top_p"),
    (CHAT, raw('{"messages": [{"role": "user", "content": "Hi"}], "presence_penalty": -Infinity}'), 400,
     "presence_penalty"),
    (C, raw('{"prompt": "Hi", "repetition_penalty": NaN}'), 400, "repetition_penalty"),
    (C, raw('{"prompt": "Hi", "min_p": NaN}'), 400, "min_p"),
    # values out of range and bad combinations
    (C, {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "Hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    (C, {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    # messages
    (CHAT, {"messages": [{"role": "w" * 65, "content": "Hi"}]}, 400, "messages"),  # custom roles: up to 64 chars
    (CHAT, {"messages": [{"content": "Hi"}]}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    (CHAT, {"prompt": "Hi"}, 400, "messages"),
    # prompts and token IDs
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [1, VOCAB]}, 400, "prompt"),
    (C, {"prompt": [1, -1]}, 400, "prompt"),
    ("/detokenize", {"tokens": [VOCAB]}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
    # not JSON, not an object, wrong types, unknown model
    (C, raw('{"prompt": "Hi"'), 400, None),
    (C, raw("[1, 2, 3]"), 400, None),
    (C, raw("\xff\xfe garbage"), 400, None),
    (C, {"prompt": "Hi", "seed": "seven"}, 400, "seed"),
    (C, {"prompt": "Hi", "model": "no-such-model"}, 404, None),
    # text that is not valid Unicode (lone UTF-16 surrogates); every field: tests/test_invalid_unicode.py
    (C, raw('{"prompt": "Hi \\ud800"}'), 400, "prompt"),
    (C, raw('{"prompt": ["Hi", "\\udc00"]}'), 400, "prompt"),
    (C, b'{"prompt": "Hi \xed\xa0\x80"}', 400, "prompt"),
    (C, raw('{"prompt": "Hi", "stop": ["\\ud800"]}'), 400, "stop"),
    (C, raw('{"prompt": "Hi", "model": "\\ud800"}'), 400, "model"),
    (C, raw('{"prompt": "Hi", "request_id": "\\ud800"}'), 400, "request_id"),
    (C, raw('{"prompt": "Hi", "structured_outputs": {"regex": "\\ud800"}}'), 400, "structured_outputs"),
    (C, raw('{"prompt": "Hi", "\\ud800": 1}'), 400, None),
    (CHAT, raw('{"messages": [{"role": "user", "content": "\\ud800"}]}'), 400, "messages"),
    (CHAT, raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'), 400,
     "messages"),
    (CHAT, raw('{"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", '
               '"function": {"name": "\\ud800"}}]}'), 400, "tools"),
    (CHAT, raw('{"messages": [{"role": "user", "content": "Hi"}], "chat_template": "\\ud800"}'), 400,
     "chat_template"),
    ("/tokenize", raw('{"prompt": "\\ud800"}'), 400, "prompt"),
    ("/tokenize", raw('{"messages": [{"role": "user", "content": "\\udfff"}]}'), 400, "messages"),
    ("/detokenize", raw('{"tokens": [1], "model": "\\ud800"}'), 400, "model"),
    # OpenAI's Responses API: its fields named, as the chat endpoint's are
    (RESPONSES, {"input": "Hi", "max_output_tokens": 10_000}, 400, "max_output_tokens"),
    (RESPONSES, {"input": "Hello " * 20_000}, 400, "input"),
    (RESPONSES, raw('{"input": "Hi", "temperature": NaN}'), 400, "temperature"),
    (RESPONSES, raw('{"input": "\\ud800"}'), 400, "input"),
    (RESPONSES, {"input": "Hi", "reasoning": {"effort": "low"}}, 400, "reasoning"),
    (RESPONSES, {"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input"),
    (RESPONSES, {"input": "Hi", "tools": [{"type": "function", "name": "f"}],
                 "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice"),
    (RESPONSES, {"input": "Hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    (RESPONSES, {"input": "Hi", "model": "no-such-model"}, 404, None),
    (RESPONSES, raw('{"input": "Hi"'), 400, None),
    # embeddings: inputs bounded and checked as prompts are, named `input`
    (EMBED, {"input": ""}, 400, "input"),
    (EMBED, {"input": []}, 400, "input"),
    (EMBED, {"input": [1] * MAX_MODEL_LEN}, 400, "input"),
    (EMBED, {"input": [1, VOCAB]}, 400, "input"),
    (EMBED, {"input": [[1, 2]] * 1025}, 400, "input"),
    (EMBED, {"input": "Hello " * 20_000}, 400, "input"),
    (EMBED, raw('{"input": "\\ud800"}'), 400, "input"),
    (EMBED, {"input": "Hi", "dimensions": 7}, 400, "dimensions"),
    (EMBED, {"input": "Hi", "encoding_format": "int8"}, 400, "encoding_format"),
    (EMBED, {"input": "Hi", "model": "no-such-model"}, 404, None),
    (EMBED, raw('{"input": "Hi"'), 400, None),
    # /pooling, /score and /rerank: the embeddings' bounds, named by their own fields
    ("/pooling", {"input": [[1, 2]] * 1025}, 400, "input"),
    ("/score", {"text_1": "Hi", "text_2": ["Hi"] * 1025}, 400, "text_2"),
    ("/score", {"text_1": ["Hi", "Ho"], "text_2": ["Hi"] * 3}, 400, "text_2"),
    ("/v1/score", {"text_1": "Hello " * 20_000, "text_2": "Hi"}, 400, "text_1"),
    ("/v1/rerank", {"query": "Hi", "documents": []}, 400, "documents"),
    ("/v2/rerank", {"query": "Hi", "documents": ["Hi", "Hello " * 20_000]}, 400, "documents"),
    ("/rerank", {"query": "Hi", "documents": ["Hi"], "use_activation": True}, 400, "use_activation"),
    # a request's chat template is refused unless the server trusts them (--trust-request-chat-template)
    (CHAT, {"messages": MESSAGES, "chat_template": "{{ messages[0]['content'] }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages[0]['content'] }}"}, 400, "chat_template"),
]


@pytest.mark.parametrize("route, body, status, param", HTTP_CASES,
                         ids=[f"{i}-{case[0].strip('/').replace('/', '_')}" for i, case in enumerate(HTTP_CASES)])
def test_bad_http_request_gets_its_4xx_and_openai_error_json(stack, route, body, status, param):
    if isinstance(body, bytes):
        response = stack.http.post(route, content=body, headers={"content-type": "application/json"})
    else:
        response = stack.http.post(route, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert_serving(stack)


def test_a_validation_message_names_the_field_and_pydantic_kind(stack):
    # vLLM's messages carry pydantic's error kind; clients written for vLLM match on it.
    for seed, kind in ((-2**63 - 1, "greater_than_equal"), (2**64, "less_than_equal")):
        response = stack.http.post(CHAT, json={"messages": MESSAGES, "seed": seed})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "seed" and error["message"].startswith("seed: ")
        assert f"[type={kind}]" in error["message"], error


# ---- HTTP, Anthropic's Messages API: (route, body, status, a word its message holds) -------------

M, COUNT = "/v1/messages", "/v1/messages/count_tokens"


def message(**fields) -> dict:
    return {"model": "", "max_tokens": 2, "messages": MESSAGES, **fields}  # "": the served model


ANTHROPIC_CASES = [
    (M, message(max_tokens=10_000), 400, "max_tokens"),
    (M, message(max_tokens=0), 400, "max_tokens"),
    (M, {"model": "", "messages": MESSAGES}, 400, "max_tokens"),
    (M, message(messages=[{"role": "user", "content": "Hello " * 20_000}]), 400, "messages"),
    (COUNT, {"model": "", "messages": [{"role": "user", "content": "Hello " * 20_000}]}, 400, "messages"),
    (M, message(system="Hello " * 20_000), 400, "messages"),
    (M, message(stop_sequences=["a"] * 65), 400, "stop_sequences"),
    (M, message(stop_sequences=["a" * 1025]), 400, "stop_sequences"),
    (M, message(top_k=2**40), 400, "top_k"),
    (M, raw('{"model": "", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}'),
     400, "temperature"),
    (M, raw('{"model": "", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}'), 400,
     "messages"),
    (M, message(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400, "image"),
    (M, message(thinking={"type": "enabled", "budget_tokens": 1024}), 400, "thinking"),
    (M, message(tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "tool",
                                                                                       "name": "g"}), 400, "g"),
    (M, message(model="no-such-model"), 404, "no-such-model"),
    (COUNT, {"model": "no-such-model", "messages": MESSAGES}, 404, "no-such-model"),
    (M, {"messages": MESSAGES, "max_tokens": 2, "model": "", "pad": "x" * (2 * 1024 * 1024)}, 413, "body"),
    (M, raw('{"model": "", "max_tokens": 2'), 400, "JSON"),
    (M, b"\xff\xfe garbage", 400, "body"),
    (COUNT, b"\x15\xff\xdf\x8f8", 400, "body"),
]


@pytest.mark.parametrize("route, body, status, word", ANTHROPIC_CASES,
                         ids=[f"{i}-{case[0].strip('/').replace('/', '_')}" for i, case in enumerate(ANTHROPIC_CASES)])
def test_bad_anthropic_request_gets_its_4xx_and_anthropic_error_json(stack, route, body, status, word):
    if isinstance(body, bytes):
        response = stack.http.post(route, content=body, headers={"content-type": "application/json"})
    else:
        response = stack.http.post(route, json=body)
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}, payload
    assert payload["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error",
                                        413: "request_too_large"}[status]
    assert word in payload["error"]["message"], payload
    served = stack.http.post(M, json=message(max_tokens=2, temperature=0))
    assert served.status_code == 200 and served.json()["usage"]["output_tokens"] == 2, served.text
    assert_serving(stack)


def test_a_body_without_a_length_is_cut_at_the_limit(stack):
    def chunks():
        for _ in range(4):
            yield b"x" * (512 * 1024)

    response = stack.http.post(C, content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and "--max-request-body-bytes" in response.json()["error"]["message"]
    assert_serving(stack)


def test_the_limit_is_named_in_the_message(stack):
    message = stack.http.post(C, json={"prompt": "Hi", "n": 20_000_000}).json()["error"]["message"]
    assert "--max-n" in message and "128" in message


# ---- gRPC: (request, status, param) ---------------------------------------------------------------


def generate(request_id="bad", prompt=(1, 2), cache_salt=None, **params) -> bytes:
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt), cache_salt=cache_salt,
                                      sampling_params=engine_pb2.SamplingParams(**params)).SerializeToString()


GRPC_CASES = [
    ("Generate", generate(n=20_000_000), grpc.StatusCode.INVALID_ARGUMENT, "n"),
    ("Generate", generate(n=129), grpc.StatusCode.INVALID_ARGUMENT, "n"),
    ("Generate", generate(request_id=""), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ("Generate", generate(request_id="r" * 257), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ("Generate", generate(temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("Generate", generate(top_p=float("inf")), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("Generate", generate(frequency_penalty=float("-inf")), grpc.StatusCode.INVALID_ARGUMENT, "frequency_penalty"),
    ("Generate", generate(logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    ("Generate", generate(prompt_logprobs=1000), grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs"),
    ("Generate", generate(stop_token_ids=list(range(65))), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
    ("Generate", generate(prompt=[1] * MAX_MODEL_LEN), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("Generate", generate(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("Generate", generate(prompt=[VOCAB]), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("Generate", generate(cache_salt=""), grpc.StatusCode.INVALID_ARGUMENT, "cache_salt"),
    ("Generate", generate(cache_salt="s" * 257), grpc.StatusCode.INVALID_ARGUMENT, "cache_salt"),
    ("Generate", generate(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("Generate", b"\xff\xff\xff\xff garbage", grpc.StatusCode.INVALID_ARGUMENT, None),
    ("Generate", b"\x0a\xff\xff\xff\xff\x0f", grpc.StatusCode.INVALID_ARGUMENT, None),  # a length past the end
    ("Abort", b"\x0a\x05ab", grpc.StatusCode.INVALID_ARGUMENT, None),
    ("GetModelInfo", b"\xff", grpc.StatusCode.INVALID_ARGUMENT, None),
    ("GetLoad", b"\x08", grpc.StatusCode.INVALID_ARGUMENT, None),
    ("Embed", engine_pb2.EmbedRequest(request_id="bad", prompt_token_ids=[]).SerializeToString(),
     grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("Embed", engine_pb2.EmbedRequest(request_id="bad", prompt_token_ids=[1] * MAX_MODEL_LEN).SerializeToString(),
     grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("Embed", engine_pb2.EmbedRequest(request_id="", prompt_token_ids=[1]).SerializeToString(),
     grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ("Embed", engine_pb2.EmbedRequest(request_id="bad", prompt_token_ids=[1], pooling_type=9).SerializeToString(),
     grpc.StatusCode.INVALID_ARGUMENT, "pooling_type"),
    ("Embed", b"\xff\xff\xff\xff garbage", grpc.StatusCode.INVALID_ARGUMENT, None),
]


@pytest.mark.parametrize("method, payload, code, param", GRPC_CASES,
                         ids=[f"{i}-{case[0]}" for i, case in enumerate(GRPC_CASES)])
def test_bad_grpc_request_gets_its_status_never_unknown(stack, method, payload, code, param):
    path = f"/tandem.engine.v1.EngineService/{method}"
    streaming = method in ("Generate", "GetTokenizer")
    call = (stack.channel.unary_stream if streaming else stack.channel.unary_unary)(
        path, request_serializer=lambda data: data, response_deserializer=lambda data: data)
    with pytest.raises(grpc.RpcError) as error:
        result = call(payload, timeout=30)
        if streaming:
            list(result)
    assert error.value.code() == code, error.value.details()
    assert error.value.details()
    if param is not None:
        assert dict(error.value.trailing_metadata())["tandem-error-param"] == param
    assert_serving(stack)


def test_the_backend_stays_healthy_after_all_that(stack):
    health = health_pb2_grpc.HealthStub(stack.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    assert stack.http.get("/health").status_code == 200
    metrics = stack.http.get("/metrics").text
    assert 'tandem:http_requests_rejected_total{limit="max_request_body_bytes"}' in metrics
    assert json.loads(stack.http.get("/version").text)["version"]
