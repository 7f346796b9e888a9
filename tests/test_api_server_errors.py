"""The OpenAI-compatible HTTP frontend against the fake engine of tests/fake_engine.py: errors,
tokenize / detokenize, clients that go away (uvicorn on loopback, since only a real server notices a
client leaving) and start-up (frontend/server.py: the tokenizer must be the backend's).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from conftest import TINY_VOCAB
from fake_engine import (CHAT, MAX_MODEL_LEN, MODEL, FakeEngine, assert_openai_error, client, engine,  # noqa: F401
                         make_client, tokenizer, tokenizer_dir)

from backend.types.errors import InvalidRequestError
from backend.types.outputs import EngineLoad, ModelInfo
from frontend import server as frontend_server
from frontend.app import create_app
from frontend.grpc_client import BackendOverloadedError, BackendUnavailableError
from frontend.server import fetch_backend_tokenizer
from frontend.tokenizer import tokenizer_fingerprint


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
