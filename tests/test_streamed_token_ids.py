"""Streamed ``return_token_ids``: every generated token's ID reaches the client once, in order.

A token can add no text when it arrives: the incremental detokenizer holds back the bytes of a
character not yet whole, and stop-string matching holds back text that may begin a stop string.
Its ID must still be streamed (vLLM writes a chunk for it), so that the streamed ``token_ids``,
joined, equal the non-streamed ones.
"""

from __future__ import annotations

import pytest
from conftest import TINY_VOCAB
from fastapi.testclient import TestClient
from fake_engine import MODEL, engine, sse_events, tokenizer, tokenizer_dir  # noqa: F401

from backend.types.outputs import ModelInfo
from frontend.app import create_app

pytestmark = pytest.mark.timeout(120)

# Characters of several bytes: the tiny byte-level vocabulary splits them across tokens.
MULTIBYTE_SCRIPT = "你好，世界！ Emoji: 😀🚀 请介绍一下你自己。"


@pytest.fixture
def client(engine, tokenizer):  # noqa: F811
    info = ModelInfo(MODEL, 2048, TINY_VOCAB, [engine.eos])
    with TestClient(create_app(engine, tokenizer, info), raise_server_exceptions=False) as test_client:
        yield test_client


def _streamed_token_ids(events: list, endpoint: str, num_choices: int) -> dict[int, list[int]]:
    collected: dict[int, list[int]] = {index: [] for index in range(num_choices)}
    for event in events[:-1]:
        for choice in event["choices"]:
            if endpoint == "/v1/chat/completions" and "role" in choice["delta"]:
                assert "token_ids" not in choice  # the role chunk carries no generated token
                continue
            collected[choice["index"]].extend(choice["token_ids"])
    return collected


CASES = [
    pytest.param({"stop": ["capital X"]}, None, id="held-by-a-stop-string-prefix"),
    pytest.param({"stop": ["ocean"], "n": 2}, None, id="stop-string-found-n2"),
    pytest.param({}, MULTIBYTE_SCRIPT, id="held-by-the-detokenizer"),
    pytest.param({"stop": ["世界！ X"], "n": 2}, MULTIBYTE_SCRIPT, id="both-n2"),
]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, script", CASES)
def test_streamed_token_ids_join_into_the_non_streamed_ones(client, engine, tokenizer, endpoint, extra,  # noqa: F811
                                                            script):
    if script is not None:
        engine.script = tokenizer.encode(script, add_special_tokens=False)
    prompt = {"prompt": "Hi"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    body = {"model": MODEL, "max_tokens": 24, "return_token_ids": True, **prompt, **extra}
    whole = client.post(endpoint, json=body)
    assert whole.status_code == 200, whole.text
    expected = {choice["index"]: choice["token_ids"] for choice in whole.json()["choices"]}
    assert all(expected.values())

    events = sse_events(client.post(endpoint, json={**body, "stream": True}))
    assert events[-1] == "[DONE]" and all("error" not in event for event in events[:-1])
    assert _streamed_token_ids(events, endpoint, len(expected)) == expected


def test_the_cases_hold_tokens_back(client, engine, tokenizer):  # noqa: F811
    """The cases above exercise what they name: some tokens add no text when they arrive."""
    for script, extra in ((None, {"stop": ["capital X"]}), (MULTIBYTE_SCRIPT, {})):
        if script is not None:
            engine.script = tokenizer.encode(script, add_special_tokens=False)
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 24, "stream": True, "return_token_ids": True, **extra}
        choices = [event["choices"][0] for event in sse_events(client.post("/v1/completions", json=body))[:-1]]
        assert any(choice["text"] == "" and choice["token_ids"] and choice["finish_reason"] is None
                   for choice in choices), script
