"""The fake engine behind the HTTP frontend's tests, and their fixtures and helpers.

``FakeEngine`` streams a fixed script of token IDs (deterministic, like greedy decoding) and records
what it was asked and which streams were closed early (an abort, per the EngineClient contract).
The fixtures build a tiny tokenizer and a Starlette TestClient over the app on the fake engine.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import pytest
from conftest import TINY_VOCAB, build_tokenizer
from fastapi.testclient import TestClient

from backend.types.outputs import EngineLoad, EngineOutput, FinishReason, Logprob, ModelInfo
from backend.types.sampling_params import SamplingParams
from frontend.app import create_app
from frontend.tokenizer import load_tokenizer


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


def make_client(engine, tokenizer, api_key=None, **app_options) -> TestClient:
    """A client of the app over ``engine``; ``app_options``: more of ``create_app``'s arguments."""
    info = ModelInfo(MODEL, MAX_MODEL_LEN, TINY_VOCAB, [engine.eos])
    return TestClient(create_app(engine, tokenizer, info, api_key=api_key, **app_options),
                      raise_server_exceptions=False)


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
