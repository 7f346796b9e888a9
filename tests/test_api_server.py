"""The OpenAI-compatible HTTP frontend (frontend/app.py, frontend/serving/, frontend/server.py) against a fake engine.

The fake streams a fixed script of token IDs (deterministic, like greedy
decoding) and records what it was asked and which streams were closed early
(an abort, per the EngineClient contract). Most tests use Starlette's
TestClient (no network); the disconnect tests run uvicorn on loopback, since
only a real server notices a client going away.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest
import uvicorn
from conftest import TINY_VOCAB, build_tokenizer
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from backend.types.errors import InvalidRequestError
from backend.types.outputs import EngineLoad, EngineOutput, FinishReason, Logprob, ModelInfo
from backend.types.sampling_params import SamplingParams
from frontend import server as frontend_server
from frontend.app import create_app
from frontend.grpc_client import BackendOverloadedError, BackendUnavailableError
from frontend.server import fetch_backend_tokenizer
from frontend.tokenizer import load_tokenizer, tokenizer_fingerprint

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-test-model"
MAX_MODEL_LEN = 128
SCRIPT = "The capital of France is Paris. The largest ocean is the Pacific Ocean."
CHAT = [{"role": "user", "content": "Hello there"}]


class FakeEngine:
    """An EngineClient that streams ``SCRIPT``'s tokens, then EOS (unless ignore_eos).

    Sequence ``i`` starts ``2 * i`` tokens into the script, so choices differ.
    The sampled token's logprob is -0.25 (rank 1); the top-k alternatives are
    the next token IDs with logprobs -1, -2, ...
    """

    def __init__(self, tokenizer, delay: float = 0.0) -> None:
        self.script = tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.eos = tokenizer.eos_token_id
        self.delay = delay
        self.fail_before_first: Optional[Exception] = None
        self.fail_after_tokens: Optional[tuple[int, Exception]] = None
        self.healthy = True
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.options: list[dict] = []  # generate()'s keyword arguments, per request
        self.closed_early: list[str] = []
        self.finished: list[str] = []

    def token(self, index: int, step: int) -> int:
        position = 2 * index + step
        return self.script[position] if position < len(self.script) else self.eos

    def position_logprobs(self, token: int, k: int) -> dict[int, Logprob]:
        position = {token: Logprob(-0.25, rank=1)}
        for j in range(k):
            position.setdefault((token + 1 + j) % TINY_VOCAB, Logprob(-1.0 - j, rank=2 + j))
        return position

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       deadline: Optional[float] = None, cache_salt: Optional[str] = None):
        self.requests.append((request_id, list(prompt_token_ids), params))
        self.options.append({"deadline": deadline, "cache_salt": cache_salt})
        if self.fail_before_first is not None:
            raise self.fail_before_first
        done = [False] * params.n
        step, sent, ended = 0, 0, False
        try:
            while not all(done):
                for index in range(params.n):
                    if done[index]:
                        continue
                    if self.fail_after_tokens is not None and sent >= self.fail_after_tokens[0]:
                        raise self.fail_after_tokens[1]
                    token = self.token(index, step)
                    finish = None
                    if token == self.eos and not params.ignore_eos or token in params.stop_token_ids:
                        finish = FinishReason.STOP
                    elif step + 1 >= params.max_tokens:
                        finish = FinishReason.LENGTH
                    done[index] = finish is not None
                    logprobs = None
                    if params.wants_logprobs:
                        logprobs = [self.position_logprobs(token, params.logprobs or 0)]
                    prompt_logprobs = None
                    if step == 0 and params.prompt_logprobs is not None:
                        prompt_logprobs = [None] + [self.position_logprobs(t, params.prompt_logprobs)
                                                    for t in prompt_token_ids[1:]]
                    sent += 1
                    ended = all(done)  # the stream is over once its last delta is out
                    yield EngineOutput(request_id, index, [token], logprobs, finish,
                                       stop_reason=token if finish == FinishReason.STOP and token != self.eos else None,
                                       num_prompt_tokens=len(prompt_token_ids), num_cached_tokens=3,
                                       prompt_logprobs=prompt_logprobs)
                    if self.delay:
                        await asyncio.sleep(self.delay)
                step += 1
        finally:
            (self.finished if ended else self.closed_early).append(request_id)

    async def embed(self, request_id: str, prompt_token_ids: list[int], pooling, *, deadline=None) -> list[float]:
        """A 4-float vector made from the prompt (its length, first and last token, the pooling)."""
        self.requests.append((request_id, list(prompt_token_ids), pooling))
        if self.fail_before_first is not None:
            raise self.fail_before_first
        return [float(len(prompt_token_ids)), float(prompt_token_ids[0]), float(prompt_token_ids[-1]),
                1.0 if pooling.type == "mean" else 0.0]

    async def abort(self, request_id: str) -> None:
        self.closed_early.append(request_id)

    async def model_info(self) -> ModelInfo:
        return ModelInfo(MODEL, MAX_MODEL_LEN, TINY_VOCAB, [self.eos])

    async def get_load(self) -> EngineLoad:
        return EngineLoad(0, 0, 0.0)

    async def health(self) -> bool:
        return self.healthy


# ---- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(str(tokenizer_dir))


@pytest.fixture
def engine(tokenizer) -> FakeEngine:
    return FakeEngine(tokenizer)


def make_client(engine, tokenizer, api_key=None) -> TestClient:
    info = ModelInfo(MODEL, MAX_MODEL_LEN, TINY_VOCAB, [engine.eos])
    return TestClient(create_app(engine, tokenizer, info, api_key=api_key), raise_server_exceptions=False)


@pytest.fixture
def client(engine, tokenizer):
    with make_client(engine, tokenizer) as test_client:
        yield test_client


def expected_text(engine: FakeEngine, tokenizer, prompt_ids: list[int], index: int, num_tokens: int) -> str:
    """What sequence ``index`` reads as after ``num_tokens`` tokens (EOS hidden)."""
    tokens = [engine.token(index, step) for step in range(num_tokens)]
    tokens = [t for t in tokens if t != engine.eos]
    return tokenizer.decode(prompt_ids + tokens)[len(tokenizer.decode(prompt_ids)):]


def sse_events(response) -> list:
    """The JSON payloads of an SSE body, and "[DONE]" as a string; checks the framing."""
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.text
    assert body.endswith("\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(response, status: int, error_type: str, param: Optional[str] = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


# ---- the app itself ---------------------------------------------------------------------------


def test_importing_and_building_the_app_does_not_import_torch(tokenizer_dir):
    code = f"""
import sys
sys.path.insert(0, {str(REPO_ROOT / 'tests')!r})
import frontend.app, frontend.server, frontend.entrypoints.cli
from backend.types.outputs import ModelInfo
from frontend.tokenizer import load_tokenizer
from test_api_server import FakeEngine
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


def test_completion_text_usage_and_engine_request(client, engine, tokenizer):
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


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "stop": [""]}, "stop"),
    ({"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": [1, 2, TINY_VOCAB]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": {"not": "a prompt"}}, "prompt"),
    ({"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
])
def test_bad_completion_requests_are_400_never_422(client, engine, body, param):
    assert_openai_error(client.post("/v1/completions", json=body), 400, "BadRequestError", param)
    assert engine.requests == []


@pytest.mark.parametrize("body, param", [
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": "Hello"}, "messages"),
    ({"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": CHAT, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_bad_chat_requests_are_400(client, body, param):
    assert_openai_error(client.post("/v1/chat/completions", json=body), 400, "BadRequestError", param)


def test_malformed_json_is_400(client):
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(response, 400, "BadRequestError")


def test_context_length_errors_use_vllms_wording(client, tokenizer):
    prompt = list(range(10, 30))  # 20 tokens
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_MODEL_LEN})
    error = assert_openai_error(response, 400, "BadRequestError", "max_tokens")
    assert error["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: {MAX_MODEL_LEN}. This model's maximum context "
        f"length is {MAX_MODEL_LEN} tokens and your request has 20 input tokens "
        f"({MAX_MODEL_LEN} > {MAX_MODEL_LEN} - 20).")
    too_long = list(range(10, 10 + MAX_MODEL_LEN + 1))
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": too_long}), 400, "BadRequestError")
    assert error["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request has "
        f"{MAX_MODEL_LEN + 1} input tokens. Please reduce the length of the input messages.")
    long_chat = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]
    error = assert_openai_error(client.post("/v1/chat/completions", json={"messages": long_chat}), 400,
                                "BadRequestError", "messages")
    assert "Please reduce the length of the input messages." in error["message"]
    short_chat = client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 1000})
    assert "'max_tokens' or 'max_completion_tokens' is too large: 1000." in short_chat.json()["error"]["message"]


def test_unknown_model_is_404(client):
    error = assert_openai_error(client.post("/v1/completions", json={"model": "gpt-5", "prompt": "Hi"}), 404,
                                "NotFoundError")
    assert error["message"] == "The model `gpt-5` does not exist."
    assert_openai_error(client.post("/v1/chat/completions", json={"model": "x", "messages": CHAT}), 404,
                        "NotFoundError")


def test_unknown_route_and_method_are_openai_errors(client):
    assert_openai_error(client.get("/v1/nothing"), 404, "NotFoundError")
    assert_openai_error(client.get("/v1/completions"), 405, "MethodNotAllowedError")


@pytest.mark.parametrize("error, status, error_type, param", [
    (InvalidRequestError("Token ID 9 is bad.", param="prompt"), 400, "BadRequestError", "prompt"),
    (BackendOverloadedError("The waiting queue is full."), 429, "RateLimitError", None),
    (BackendUnavailableError("Backend unavailable: connection refused"), 503, "ServiceUnavailableError", None),
    (RuntimeError("a bug"), 500, "InternalServerError", None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_errors_before_the_first_token_get_their_status(client, engine, error, status, error_type, param,
                                                               stream):
    engine.fail_before_first = error
    response = client.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
    assert_openai_error(response, status, error_type, param)
    response = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": stream})
    assert_openai_error(response, status, error_type, param)


def test_api_key(engine, tokenizer):
    with make_client(engine, tokenizer, api_key="s3cret") as client:
        request = {"prompt": "Hi", "max_tokens": 2}
        assert_openai_error(client.post("/v1/completions", json=request), 401, "AuthenticationError")
        assert_openai_error(client.post("/v1/completions", json=request, headers={"Authorization": "Bearer nope"}),
                            401, "AuthenticationError")
        assert_openai_error(client.get("/v1/models", headers={"Authorization": "s3cret"}), 401,
                            "AuthenticationError")
        assert_openai_error(client.post("/tokenize", json={"prompt": "x"}), 401, "AuthenticationError")
        assert engine.requests == []
        good = {"Authorization": "Bearer s3cret"}
        assert client.post("/v1/completions", json=request, headers=good).status_code == 200
        assert client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1},
                           headers=good).status_code == 200
        assert client.get("/v1/models", headers=good).status_code == 200
        for open_route in ("/health", "/metrics", "/version"):
            assert client.get(open_route).status_code == 200, open_route


# ---- tokenize / detokenize --------------------------------------------------------------------


def test_tokenize_and_detokenize(client, tokenizer):
    body = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert body == {"tokens": tokenizer.encode("Hello world"), "count": len(tokenizer.encode("Hello world")),
                    "max_model_len": MAX_MODEL_LEN, "token_strs": None}
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    assert tokenizer.decode(chat["tokens"]).endswith("<|im_start|>assistant\n") and chat["count"] == len(chat["tokens"])
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "Hello world"}
    assert_openai_error(client.post("/tokenize", json={"prompt": "x", "messages": CHAT}), 400, "BadRequestError")
    assert_openai_error(client.post("/detokenize", json={"tokens": [TINY_VOCAB]}), 400, "BadRequestError", "tokens")
    assert_openai_error(client.post("/detokenize", json={"tokens": ["a"]}), 400, "BadRequestError", "tokens")
    assert_openai_error(client.post("/tokenize", json={"model": "other", "prompt": "x"}), 404, "NotFoundError")


# ---- clients that go away ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_server(tokenizer):
    """uvicorn on loopback (in a thread) over a slow fake engine: 5 tokens/s."""
    engine = FakeEngine(tokenizer, delay=0.2)
    app = create_app(engine, tokenizer, ModelInfo(MODEL, MAX_MODEL_LEN, TINY_VOCAB, [engine.eos]))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.config.port}", engine
    server.should_exit = True
    thread.join(timeout=10)


def wait_for(condition, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 100}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 100, "ignore_eos": True}),
])
def test_client_disconnecting_mid_stream_aborts_the_engine_request(live_server, route, body):
    base, engine = live_server
    with httpx.Client(base_url=base, timeout=10) as http:
        with http.stream("POST", route, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        # Leaving the block closed the connection while the engine had ~19 s of tokens to go.
    assert wait_for(lambda: len(engine.closed_early) == 1), "the engine stream was not closed"
    assert engine.finished == []


def test_client_disconnecting_before_a_non_streamed_answer_aborts(live_server):
    base, engine = live_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 100, "ignore_eos": True},
                   timeout=0.5)
    assert wait_for(lambda: len(engine.closed_early) == 1), "the engine stream was not closed"
    assert engine.finished == []


# ---- startup: the tokenizer must be the backend's ---------------------------------------------


class StartupFakeBackend:
    """What ``serve`` asks a GrpcEngineClient at startup, serving ``files_dir``'s tokenizer."""

    def __init__(self, address: str, files_dir: Path) -> None:
        self.files_dir = files_dir
        self.fetches = 0

    async def health(self) -> bool:
        return True

    async def model_info(self) -> ModelInfo:
        return ModelInfo(MODEL, MAX_MODEL_LEN, TINY_VOCAB)

    async def tokenizer_fingerprint(self) -> str:
        return tokenizer_fingerprint(str(self.files_dir))

    def expect_tokenizer(self, fingerprint: str) -> None:
        pass

    async def get_load(self) -> EngineLoad:
        return EngineLoad(0, 0, 0.0)

    async def fetch_tokenizer(self, dest_dir) -> Path:
        self.fetches += 1
        for path in self.files_dir.iterdir():
            (Path(dest_dir) / path.name).write_bytes(path.read_bytes())
        return Path(dest_dir)

    async def close(self) -> None:
        pass


def test_frontend_refuses_a_tokenizer_that_is_not_the_backends(tokenizer_dir, tmp_path, monkeypatch, capsys):
    import frontend.grpc_client

    other = tmp_path / "other"
    other.mkdir()
    for path in tokenizer_dir.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    (other / "tokenizer_config.json").write_text(
        (tokenizer_dir / "tokenizer_config.json").read_text().replace("im_start", "im_begin"))
    monkeypatch.setattr(frontend.grpc_client, "GrpcEngineClient",
                        lambda address, limits, security: StartupFakeBackend(address, tokenizer_dir))
    code = frontend_server.main(["--backend", "127.0.0.1:1", "--tokenizer", str(other), "--port", str(free_port())])
    assert code == 1
    assert "is not the backend's" in capsys.readouterr().err


def test_fetched_tokenizer_is_cached_by_fingerprint(tokenizer_dir, tmp_path):
    backend = StartupFakeBackend("x", tokenizer_dir)
    fingerprint = tokenizer_fingerprint(str(tokenizer_dir))
    first = asyncio.run(fetch_backend_tokenizer(backend, fingerprint, tmp_path))
    assert first == tmp_path / "tokenizers" / fingerprint
    assert tokenizer_fingerprint(str(first)) == fingerprint
    second = asyncio.run(fetch_backend_tokenizer(backend, fingerprint, tmp_path))
    assert second == first and backend.fetches == 1
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [fingerprint]  # no staging left behind
