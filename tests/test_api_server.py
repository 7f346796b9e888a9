"""The OpenAI-compatible HTTP frontend (frontend/app.py, frontend/serving/) against the fake engine
of tests/fake_engine.py: the app itself, completions, chat and streaming, through Starlette's
TestClient (no network). Errors, tokenize, clients going away and start-up are in
tests/test_api_server_errors.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from fake_engine import (CHAT, MAX_MODEL_LEN, MODEL, REPO_ROOT, SCRIPT, assert_openai_error, client, engine,  # noqa: F401
                         expected_text, make_client, sse_events, tokenizer, tokenizer_dir)
from prometheus_client.parser import text_string_to_metric_families

from frontend.grpc_client import BackendUnavailableError


# ---- the app itself ---------------------------------------------------------------------------


def test_importing_and_building_the_app_does_not_import_torch(tokenizer_dir):
    code = f"""
import sys
sys.path.insert(0, {str(REPO_ROOT / 'tests')!r})
import frontend.app, frontend.server, frontend.entrypoints.cli
from backend.types.outputs import ModelInfo
from frontend.tokenizer import load_tokenizer
from fake_engine import FakeEngine
tokenizer = load_tokenizer({str(tokenizer_dir)!r})
frontend.app.create_app(FakeEngine(tokenizer), tokenizer, ModelInfo("m", 64, 384))
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_models_version_and_health(client, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get("/version").json()["version"]
    assert client.get("/health").status_code == 200
    engine.healthy = False
    assert_openai_error(client.get("/health"), 503, "ServiceUnavailableError")


def test_health_is_503_when_the_health_check_raises(client, engine):
    async def unreachable():
        raise BackendUnavailableError("connection refused")

    engine.health = unreachable
    assert client.get("/health").status_code == 503


def test_health_names_this_process_when_serve_asked_it_to(engine, tokenizer, monkeypatch):
    """`tandem serve` sets $TANDEM_INSTANCE_ID and waits for it on /health: no other server can pass."""
    monkeypatch.setenv("TANDEM_INSTANCE_ID", "abc123")
    with make_client(engine, tokenizer) as test_client:
        assert test_client.get("/health").headers["x-tandem-instance"] == "abc123"
        engine.healthy = False
        assert "x-tandem-instance" not in test_client.get("/health").headers  # not ready: no claim


def test_request_id_is_echoed_or_generated(client):
    response = client.get("/v1/models", headers={"X-Request-Id": "my-id-42"})
    assert response.headers["x-request-id"] == "my-id-42"
    first, second = client.get("/v1/models"), client.get("/v1/models")
    assert first.headers["x-request-id"] and first.headers["x-request-id"] != second.headers["x-request-id"]


def test_metrics_count_requests_by_route_and_status(client):
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": -1})
    client.get("/no/such/route")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(client.get("/metrics").text) for s in family.samples}

    def value(name: str, **labels) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    completions = dict(route="/v1/completions", method="POST")
    assert value("tandem:http_requests_total", status="200", **completions) == 1
    assert value("tandem:http_requests_total", status="400", **completions) == 1
    assert value("tandem:http_requests_total", route="other", method="GET", status="404") == 1
    assert value("tandem:http_request_duration_seconds_count", **completions) == 2
    assert value("tandem:http_requests_in_progress") == 1  # this /metrics request itself


# ---- completions ------------------------------------------------------------------------------


def test_completion_text_usage_and_engine_request(engine, tokenizer):
    with make_client(engine, tokenizer, enable_prompt_tokens_details=True) as client:
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5,
                                                        "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    prompt_ids = tokenizer.encode("Hello")
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["text"] == expected_text(engine, tokenizer, prompt_ids, 0, 5)
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                             "total_tokens": len(prompt_ids) + 5, "prompt_tokens_details": {"cached_tokens": 3}}
    (request_id, sent_ids, params), = engine.requests
    assert request_id == body["id"] + "-0" and sent_ids == prompt_ids
    assert params.max_tokens == 5 and params.temperature == 0 and params.n == 1


def test_completion_max_tokens_defaults_to_16_capped_by_the_context(client, engine):
    client.post("/v1/completions", json={"prompt": "Hi"})
    long_prompt = list(range(10, 10 + MAX_MODEL_LEN - 4))
    client.post("/v1/completions", json={"prompt": long_prompt})
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": None})
    assert [params.max_tokens for _, _, params in engine.requests] == [16, 4, MAX_MODEL_LEN - 2]


def test_completion_prompt_forms_and_choice_indices(client, engine, tokenizer):
    prompts = ["The capital", "Once upon", "def add"]
    body = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 3, "n": 2}).json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    ids = [request_id for request_id, _, _ in engine.requests]
    assert sorted(ids) == [f"{body['id']}-{i}" for i in range(3)]
    for choice in body["choices"]:
        prompt_index, seq_index = divmod(choice["index"], 2)
        assert choice["text"] == expected_text(engine, tokenizer, tokenizer.encode(prompts[prompt_index]),
                                               seq_index, 3)
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in prompts)
    assert body["usage"]["completion_tokens"] == 6 * 3

    engine.requests.clear()
    token_prompt = tokenizer.encode("Once upon")
    one = client.post("/v1/completions", json={"prompt": token_prompt, "max_tokens": 2}).json()
    assert len(one["choices"]) == 1 and engine.requests[0][1] == token_prompt
    many = client.post("/v1/completions", json={"prompt": [token_prompt, [5, 6, 7]], "max_tokens": 2}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1]
    assert engine.requests[-1][1] in ([5, 6, 7], token_prompt) and len(engine.requests) == 3


def test_completion_passes_every_sampling_field(client, engine):
    response = client.post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_tokens": 2,
        "ignore_eos": True, "stop_token_ids": [7], "seed": 1234, "skip_special_tokens": False,
        "spaces_between_special_tokens": False, "include_stop_str_in_output": True, "stop": "zzz"})
    assert response.status_code == 200, response.text
    params = engine.requests[0][2]
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, 5, 0.1)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (params.min_tokens, params.ignore_eos, params.stop_token_ids, params.seed) == (2, True, [7], 1234)
    assert params.skip_special_tokens is False and params.spaces_between_special_tokens is False
    assert params.include_stop_str_in_output is True and params.stop == ["zzz"]


def test_completion_stop_string_cuts_the_text_and_aborts_the_engine_request(client, engine, tokenizer):
    body = client.post("/v1/completions", json={"prompt": "Q:", "max_tokens": 20, "stop": [" Paris"],
                                                "n": 2}).json()
    full = [expected_text(engine, tokenizer, tokenizer.encode("Q:"), i, 20) for i in range(2)]
    for choice in body["choices"]:
        assert choice["text"] == full[choice["index"]].split(" Paris")[0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == " Paris"
    # Both sequences ended on the stop string long before max_tokens: the request was closed early.
    assert engine.closed_early == [body["id"] + "-0"] and engine.finished == []


def test_completion_stop_token_hides_eos_and_reports_length_otherwise(client, engine, tokenizer):
    body = client.post("/v1/completions", json={"prompt": "Q:", "max_tokens": 100}).json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None  # EOS
    assert choice["text"] == expected_text(engine, tokenizer, tokenizer.encode("Q:"), 0, len(engine.script) + 1)
    assert choice["text"].endswith("Ocean.") and "<|im_end|>" not in choice["text"]
    assert body["usage"]["completion_tokens"] == len(engine.script) + 1  # EOS counts as a completion token


def test_completion_echo_and_logprobs_in_the_legacy_format(client, engine, tokenizer):
    prompt_ids = tokenizer.encode("The capital")
    body = client.post("/v1/completions", json={"prompt": "The capital", "max_tokens": 3, "echo": True,
                                                "logprobs": 2}).json()
    (choice,) = body["choices"]
    assert choice["text"] == "The capital" + expected_text(engine, tokenizer, prompt_ids, 0, 3)
    logprobs = choice["logprobs"]
    count = len(prompt_ids) + 3
    assert all(len(logprobs[key]) == count for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == [-0.25] * (count - 1)
    assert all(1 <= len(top) <= 3 for top in logprobs["top_logprobs"][1:])  # chosen + top-2
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"]))
    assert engine.requests[0][2].prompt_logprobs == 2 and engine.requests[0][2].logprobs == 2


def test_completion_logprobs_without_echo(client, engine):
    choice = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "logprobs": 0}).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == 4 and logprobs["token_logprobs"] == [-0.25] * 4
    assert [len(top) for top in logprobs["top_logprobs"]] == [1] * 4  # sampled token only
    assert engine.requests[0][2].prompt_logprobs is None


# ---- chat -------------------------------------------------------------------------------------


def test_chat_completion_renders_the_template_and_defaults_max_tokens_to_the_room_left(client, engine, tokenizer):
    body = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT}).json()
    prompt_ids = engine.requests[0][1]
    assert tokenizer.decode(prompt_ids) == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert engine.requests[0][2].max_tokens == MAX_MODEL_LEN - len(prompt_ids)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": SCRIPT, "tool_calls": [], "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None,
                                 "reasoning_content": None}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None


def test_chat_max_completion_tokens_wins_and_n_gives_indices(client, engine, tokenizer):
    body = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 9,
                                                     "max_completion_tokens": 4, "n": 2}).json()
    assert engine.requests[0][2].max_tokens == 4
    assert [c["index"] for c in body["choices"]] == [0, 1]
    prompt_ids = engine.requests[0][1]
    assert [c["message"]["content"] for c in body["choices"]] == [
        expected_text(engine, tokenizer, prompt_ids, i, 4) for i in range(2)]
    assert body["usage"]["completion_tokens"] == 8


def test_chat_logprobs_format(client, engine):
    body = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "logprobs": True,
                                                     "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert "".join(entry["token"] for entry in content) == body["choices"][0]["message"]["content"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] == -0.25 and entry["bytes"] == list(entry["token"].encode())
        assert [top["logprob"] for top in entry["top_logprobs"]] == [-0.25, -1.0]  # the 2 most likely
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    assert engine.requests[0][2].logprobs == 2
    plain = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "logprobs": True}).json()
    assert all(entry["top_logprobs"] == [] for entry in plain["choices"][0]["logprobs"]["content"])


def test_chat_stop_string(client, engine):
    body = client.post("/v1/chat/completions", json={"messages": CHAT, "stop": ["France"],
                                                     "include_stop_str_in_output": True}).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "The capital of France"
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "France"
    assert len(engine.closed_early) == 1


# ---- streaming --------------------------------------------------------------------------------


def check_stream_contract(events: list, n_choices: int, include_usage: bool) -> dict[int, list[dict]]:
    """finish_reason once per choice in its last chunk; usage chunk; [DONE] last. Returns chunks by choice."""
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    if include_usage:
        usage_chunk = chunks.pop()
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == (
            usage_chunk["usage"]["prompt_tokens"] + usage_chunk["usage"]["completion_tokens"])
    assert all(chunk.get("usage") is None for chunk in chunks)
    by_choice: dict[int, list[dict]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(by_choice) == list(range(n_choices))
    for choices in by_choice.values():
        finishes = [c["finish_reason"] for c in choices]
        assert finishes[-1] is not None and all(f is None for f in finishes[:-1])
    return by_choice


@pytest.mark.parametrize("stop", [None, [" ocean"]])
def test_completion_stream_contract_and_joined_text_equals_non_streamed(client, stop):
    request = {"prompt": ["Q:", "A:"], "max_tokens": 30, "temperature": 0, "n": 2, "stop": stop}
    plain = client.post("/v1/completions", json=request).json()
    streamed = client.post("/v1/completions", json={**request, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    events = sse_events(streamed)
    by_choice = check_stream_contract(events, 4, include_usage=True)
    for choice in plain["choices"]:
        chunks = by_choice[choice["index"]]
        assert "".join(c["text"] for c in chunks) == choice["text"]
        assert chunks[-1]["finish_reason"] == choice["finish_reason"]
    assert events[-2]["usage"] == plain["usage"]
    assert all(event["object"] == "text_completion" for event in events[:-1])


def test_completion_stream_echo_and_logprob_offsets(client, tokenizer):
    request = {"prompt": "The capital", "max_tokens": 4, "echo": True, "logprobs": 1}
    plain = client.post("/v1/completions", json=request).json()["choices"][0]
    chunks = check_stream_contract(sse_events(client.post("/v1/completions", json={**request, "stream": True})),
                                   1, include_usage=False)[0]
    assert chunks[0]["text"].startswith("The capital")
    assert "".join(c["text"] for c in chunks) == plain["text"]
    joined = {key: [v for c in chunks for v in c["logprobs"][key]] for key in plain["logprobs"]}
    assert joined["tokens"] == plain["logprobs"]["tokens"]
    assert joined["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert joined["text_offset"] == plain["logprobs"]["text_offset"]


def test_chat_stream_contract(client):
    request = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "n": 2, "logprobs": True, "top_logprobs": 1}
    plain = client.post("/v1/chat/completions", json=request).json()
    events = sse_events(client.post("/v1/chat/completions", json={**request, "stream": True,
                                                                   "stream_options": {"include_usage": True}}))
    by_choice = check_stream_contract(events, 2, include_usage=True)
    assert all(event["object"] == "chat.completion.chunk" for event in events[:-1])
    for choice in plain["choices"]:
        chunks = by_choice[choice["index"]]
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in chunks[1:])
        assert "".join(c["delta"].get("content", "") for c in chunks) == choice["message"]["content"]
        streamed_logprobs = [e for c in chunks[1:] for e in c["logprobs"]["content"]]
        assert streamed_logprobs == choice["logprobs"]["content"]
    assert events[-2]["usage"] == plain["usage"]


def test_chat_stream_without_usage_has_no_usage_chunk(client):
    events = sse_events(client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3,
                                                                   "stream": True}))
    check_stream_contract(events, 1, include_usage=False)


def test_error_after_the_stream_started_is_sent_in_the_stream(client, engine):
    engine.fail_after_tokens = (3, BackendUnavailableError("Backend unavailable: the connection dropped"))
    response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 10, "stream": True})
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 503 and "connection dropped" in error["message"]
    assert "".join(e["choices"][0]["text"] for e in events[:-2])  # the text before the error came through
