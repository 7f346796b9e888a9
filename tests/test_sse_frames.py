"""Streamed chunks are written without pydantic models (frontend.serving.sse.ChunkFrames); each must
still be, byte for byte, what the response model writes for it.

Every event of streamed completions and chats (text with quotes, control characters, non-ASCII
and U+2028; logprobs with -inf, NaN and tiny values; stop strings and stop tokens; n > 1, echo,
return_token_ids, tool calls) is parsed back into its model and dumped again: the dump must equal
the bytes sent.
"""

from __future__ import annotations

import json

import pytest
from conftest import TINY_VOCAB, build_tokenizer
from fastapi.testclient import TestClient

from backend.types.outputs import EngineLoad, EngineOutput, FinishReason, Logprob, ModelInfo
from frontend import protocol as P
from frontend.app import create_app
from frontend.tokenizer import load_tokenizer

TRICKY = 'Say "hi"\\n\x01 — café 😀\u2028 end. ' * 2
ODD_LOGPROBS = [float("-inf"), float("nan"), -1e-7, -0.0, -12345.678, -2.5e-12]


class TrickyEngine:
    """Streams TRICKY's tokens one per delta; logprobs cycle through ODD_LOGPROBS."""

    def __init__(self, tokenizer) -> None:
        self.script = tokenizer.encode(TRICKY, add_special_tokens=False)
        self.eos = tokenizer.eos_token_id

    async def generate(self, request_id, prompt_token_ids, params, *, deadline=None, cache_salt=None):
        count = min(params.max_tokens, len(self.script))
        for step in range(count):
            for index in range(params.n):
                token = self.script[(step + index) % len(self.script)]
                logprobs = None
                if params.wants_logprobs:
                    position = {token: Logprob(ODD_LOGPROBS[step % len(ODD_LOGPROBS)], rank=1)}
                    for j in range(params.logprobs or 0):
                        position.setdefault((token + 1 + j) % TINY_VOCAB,
                                            Logprob(ODD_LOGPROBS[(step + j + 1) % len(ODD_LOGPROBS)], rank=2 + j))
                    logprobs = [position]
                last = step == count - 1
                prompt_logprobs = None
                if step == 0 and params.prompt_logprobs is not None:
                    prompt_logprobs = [None] + [{t: Logprob(-1.5, rank=1)} for t in prompt_token_ids[1:]]
                yield EngineOutput(request_id, index, [token], logprobs,
                                   FinishReason.LENGTH if last else None, num_prompt_tokens=len(prompt_token_ids),
                                   prompt_logprobs=prompt_logprobs)

    async def abort(self, request_id):
        pass

    async def model_info(self):
        return ModelInfo("model \"x\" é", 4096, TINY_VOCAB, [self.eos])

    async def get_load(self):
        return EngineLoad(0, 0, 0.0)

    async def health(self):
        return True


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    tokenizer = load_tokenizer(str(directory))
    info = ModelInfo("model \"x\" é", 4096, TINY_VOCAB, [tokenizer.eos_token_id])
    with TestClient(create_app(TrickyEngine(tokenizer), tokenizer, info)) as test_client:
        yield test_client


def _events(response) -> list[bytes]:
    assert response.status_code == 200, response.text
    raw = response.content
    assert raw.endswith(b"data: [DONE]\n\n")
    return [event for event in raw.split(b"\n\n")[:-2]]  # the last two: [DONE] and the empty tail


def _assert_model_bytes(events: list[bytes], model) -> int:
    for event in events:
        assert event.startswith(b"data: ")
        body = event[len(b"data: "):]
        assert "error" not in json.loads(body), body
        assert body.decode() == model.model_validate_json(body).model_dump_json()
    return len(events)


COMPLETION_CASES = [
    {},
    {"logprobs": 2},
    {"logprobs": 0, "echo": True},
    {"n": 2, "logprobs": 1, "return_token_ids": True},
    {"stop": ["caf"], "logprobs": 1},
    {"stop": ["end"], "include_stop_str_in_output": True},
    {"return_tokens_as_token_ids": True, "logprobs": 1},
    {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    {"prompt_logprobs": 1, "logprobs": 1},
]


@pytest.mark.parametrize("extra", COMPLETION_CASES)
def test_streamed_completion_chunks_are_the_models_bytes(client, extra):
    body = {"prompt": "Q: " + TRICKY, "max_tokens": 24, "stream": True, "request_id": 'id "q" é', **extra}
    events = _events(client.post("/v1/completions", json=body))
    assert _assert_model_bytes(events, P.CompletionStreamResponse) >= 2


CHAT_CASES = [
    {},
    {"logprobs": True, "top_logprobs": 2},
    {"logprobs": True},
    {"n": 2, "logprobs": True, "top_logprobs": 1, "return_token_ids": True},
    {"stop": ["caf"]},
    {"return_tokens_as_token_ids": True, "logprobs": True, "top_logprobs": 1},
    {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
     "tool_choice": {"type": "function", "function": {"name": "f"}}},
    {"return_token_ids": True, "stream_options": {"include_usage": True}},
    {"stop": ["end"], "return_token_ids": True},
]


@pytest.mark.parametrize("extra", CHAT_CASES)
def test_streamed_chat_chunks_are_the_models_bytes(client, extra):
    body = {"messages": [{"role": "user", "content": TRICKY}], "max_tokens": 24, "stream": True,
            "request_id": 'id "c" é', **extra}
    events = _events(client.post("/v1/chat/completions", json=body))
    assert _assert_model_bytes(events, P.ChatCompletionStreamResponse) >= 2


def test_the_fast_path_writes_the_odd_values_as_the_models_do(client):
    """-inf is clamped to -9999.0 (a float, not -9999), NaN too, and text keeps its characters."""
    body = {"prompt": "Q:", "max_tokens": 6, "stream": True, "logprobs": 1}
    text = b"".join(_events(client.post("/v1/completions", json=body)))
    assert b"-9999.0" in text and b"-9999," not in text and b"NaN" not in text
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True}
    chunks = [json.loads(event[6:]) for event in _events(client.post("/v1/chat/completions", json=body))]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == TRICKY[:len(streamed)] and len(streamed) > 5


def _chunks(response) -> list[dict]:
    return [json.loads(event[len(b"data: "):]) for event in _events(response)]


@pytest.mark.parametrize("return_token_ids", [False, True])
def test_chat_chunks_leave_out_unset_keys_as_vllm_does(client, return_token_ids):
    """vLLM writes chat chunks without their unset keys: prompt_token_ids only in the first chunk,
    token_ids only with return_token_ids, stop_reason only with the finish, usage only when asked;
    OpenAI's logprobs and finish_reason are always there. A client that extends its token list
    from every chunk holding token_ids (vLLM's test does) gets the reply's tokens."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
            "return_token_ids": return_token_ids}
    chunks = _chunks(client.post("/v1/chat/completions", json=body))
    assert ("prompt_token_ids" in chunks[0]) is return_token_ids
    assert all("prompt_token_ids" not in chunk and "usage" not in chunk for chunk in chunks[1:])
    collected = []
    for chunk in chunks:
        (choice,) = chunk["choices"]
        assert choice["logprobs"] is None and "finish_reason" in choice
        assert ("stop_reason" in choice) is (choice["finish_reason"] is not None)
        assert ("token_ids" in choice) is (return_token_ids and "role" not in choice["delta"])
        collected += choice.get("token_ids", [])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(collected) == (6 if return_token_ids else 0)
    usage = _chunks(client.post("/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}))
    assert usage[-1]["choices"] == [] and usage[-1]["usage"]["completion_tokens"] == 6
    assert set(usage[-1]) == {"id", "object", "created", "model", "choices", "usage"}


def test_completion_chunks_carry_vllms_keys_and_prompt_logprobs_only_where_sent(client):
    """vLLM writes every key of its completion chunks (null when unset); Tandem's streamed
    prompt_logprobs (vLLM streams none) appear only in the first chunk of each choice."""
    body = {"prompt": "Q:", "max_tokens": 4, "stream": True}
    for chunk in _chunks(client.post("/v1/completions", json=body)):
        (choice,) = chunk["choices"]
        assert choice["token_ids"] is None and choice["prompt_token_ids"] is None and "prompt_logprobs" not in choice
        assert "stop_reason" in choice and chunk["usage"] is None
    chunks = _chunks(client.post("/v1/completions", json={**body, "prompt_logprobs": 1, "return_token_ids": True}))
    assert chunks[0]["choices"][0]["prompt_logprobs"][0] is None and chunks[0]["choices"][0]["prompt_token_ids"]
    assert all("prompt_logprobs" not in chunk["choices"][0] for chunk in chunks[1:])
    assert sum(len(chunk["choices"][0]["token_ids"]) for chunk in chunks) == 4


def test_the_openai_sdk_sees_token_ids_as_vllms_test_reads_them(client):
    """vLLM's return_token_ids test, through the openai SDK: the first chunk has prompt_token_ids,
    no later one has the key, and every chunk holding token_ids holds a list."""
    import openai

    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    stream = sdk.chat.completions.create(model='model "x" é', messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=6, stream=True, extra_body={"return_token_ids": True})
    chunks = list(stream)
    assert chunks[0].prompt_token_ids and all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    collected = []
    for chunk in chunks:
        if "token_ids" in chunk.choices[0].model_dump():
            collected.extend(chunk.choices[0].token_ids)
    assert len(collected) == 6
