"""vLLM's -1 in the logprobs counts: "the whole vocabulary", bounded by --max-logprobs (whose own -1 is
the vocabulary size too). Chat's ``top_logprobs``, completions' ``logprobs`` and both endpoints'
``prompt_logprobs`` take it, as vLLM's current protocol does. Other negative counts are a 400 naming
the field. Checked at each layer: the limits, the sampling parameters, the sampler, the engine's
request checks and the HTTP frontend (fake engine)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from conftest import TINY_VOCAB
from fastapi.testclient import TestClient
from fake_engine import CHAT, MODEL, assert_openai_error, engine, tokenizer, tokenizer_dir  # noqa: F401
from helpers import LoopThread, backend_and_frontend

from backend.engine.request_checks import validate_request
from backend.types.errors import InvalidRequestError
from backend.types.limits import Limits
from backend.types.outputs import ModelInfo
from backend.types.sampling_params import SamplingParams
from backend.worker.logprobs import compute_prompt_logprobs
from backend.worker.sampler import Sampler, SamplingRow
from frontend.app import create_app

# ---- the bound ---------------------------------------------------------------------------------


def test_minus_one_is_the_vocabulary_and_must_fit_max_logprobs():
    assert Limits(max_logprobs=-1).logprobs_count("top_logprobs", -1, 100) == 100
    assert Limits(max_logprobs=100).logprobs_count("top_logprobs", -1, 100) == 100
    assert Limits().logprobs_count("logprobs", 7, 100) == 7
    with pytest.raises(InvalidRequestError, match="--max-logprobs") as error:
        Limits().logprobs_count("prompt_logprobs", -1, 100)  # 100 > 20
    assert error.value.param == "prompt_logprobs" and "whole vocabulary" in str(error.value)
    with pytest.raises(InvalidRequestError, match="at most 100") as error:  # --max-logprobs -1: the vocabulary
        Limits(max_logprobs=-1).logprobs_count("top_logprobs", 101, 100)
    assert error.value.param == "top_logprobs"


def test_other_negative_counts_are_refused_naming_the_field():
    for limits in (Limits(), Limits(max_logprobs=-1)):
        with pytest.raises(InvalidRequestError, match="-1 .the whole vocabulary. or non-negative") as error:
            limits.logprobs_count("top_logprobs", -2, 100)
        assert error.value.param == "top_logprobs"
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(prompt_logprobs=-3)
    assert error.value.param == "prompt_logprobs"
    with pytest.raises(InvalidRequestError, match="max_logprobs must be at least 1"):
        Limits(max_logprobs=-2)


def test_an_unknown_vocabulary_leaves_minus_one_to_an_uncapped_server_only():
    """The gRPC edge checks before it knows the vocabulary; the engine checks again knowing it."""
    Limits(max_logprobs=-1).check_sampling_params(SamplingParams(logprobs=-1, prompt_logprobs=-1), None)
    with pytest.raises(InvalidRequestError) as error:
        Limits().check_sampling_params(SamplingParams(logprobs=-1), None)
    assert error.value.param == "logprobs"


def test_the_engine_checks_minus_one_against_its_vocabulary():
    validate_request([1, 2], SamplingParams(logprobs=-1, prompt_logprobs=-1), 50, 100, Limits(max_logprobs=-1))
    validate_request([1, 2], SamplingParams(prompt_logprobs=-1), 50, 100, Limits(max_logprobs=50))
    with pytest.raises(InvalidRequestError) as error:
        validate_request([1, 2], SamplingParams(prompt_logprobs=-1), 50, 100, Limits(max_logprobs=49))
    assert error.value.param == "prompt_logprobs"


def test_beam_search_still_returns_only_the_chosen_tokens_logprobs():
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(n=2, use_beam_search=True, temperature=0.0, logprobs=-1)
    assert error.value.param == "logprobs"


# ---- the sampler lists every token -------------------------------------------------------------


def test_the_sampler_lists_every_token_for_minus_one():
    torch.manual_seed(3)
    logits = torch.randn(2, 40)
    out = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0.0, logprobs=-1), [1], [], None),
                             SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [1], [], None)])
    everything = out.logprobs[0]
    assert len(everything) == 40 and list(everything)[0] == out.token_ids[0]
    raw = torch.log_softmax(logits[0], -1)
    assert sorted(lp.rank for lp in everything.values()) == list(range(1, 41))
    assert everything[7].logprob == pytest.approx(raw[7].item(), abs=1e-6)
    assert len(out.logprobs[1]) == 2  # the other row keeps its own count (greedy: the chosen is the top one)
    positions = compute_prompt_logprobs(logits, [5, 9], num_top=-1)
    assert [len(p) for p in positions] == [40, 40] and [list(p)[0] for p in positions] == [5, 9]


# ---- the HTTP frontend -------------------------------------------------------------------------


def _client(engine, tokenizer, limits: Limits) -> TestClient:
    info = ModelInfo(MODEL, 2048, TINY_VOCAB, [engine.eos])
    return TestClient(create_app(engine, tokenizer, info, limits=limits), raise_server_exceptions=False)


def _chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2, **body})


def _completion(client, **body):
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi there", "max_tokens": 2, **body})


# A server bound large enough: -1 (the vocabulary) or the vocabulary size itself.
BOUNDS_THAT_FIT = [pytest.param(Limits(max_logprobs=-1), id="max_logprobs=-1"),
                   pytest.param(Limits(max_logprobs=TINY_VOCAB), id="max_logprobs=vocab")]


@pytest.mark.parametrize("limits", BOUNDS_THAT_FIT)
def test_top_and_prompt_logprobs_minus_one_reach_the_engine_as_the_vocabulary(engine, tokenizer, limits):
    with _client(engine, tokenizer, limits) as client:
        response = _chat(client, logprobs=True, top_logprobs=-1, prompt_logprobs=-1)
        assert response.status_code == 200, response.text
        params = engine.requests[-1][2]
        assert params.logprobs == TINY_VOCAB and params.prompt_logprobs == TINY_VOCAB
        body = response.json()
        assert all(len(entry["top_logprobs"]) == TINY_VOCAB for entry in body["choices"][0]["logprobs"]["content"])
        assert len(body["prompt_logprobs"][1]) == TINY_VOCAB
        streamed = _chat(client, logprobs=True, top_logprobs=-1, stream=True)
        assert streamed.status_code == 200 and '"top_logprobs":[' in streamed.text
        assert _completion(client, prompt_logprobs=-1).status_code == 200
        assert engine.requests[-1][2].prompt_logprobs == TINY_VOCAB


@pytest.mark.parametrize("limits", BOUNDS_THAT_FIT)
def test_completion_logprobs_minus_one_is_the_vocabulary(engine, tokenizer, limits):
    """vLLM's completions take -1 in ``logprobs`` too (its current protocol), within --max-logprobs."""
    with _client(engine, tokenizer, limits) as client:
        response = _completion(client, logprobs=-1)
        assert response.status_code == 200, response.text
        assert engine.requests[-1][2].logprobs == TINY_VOCAB
        logprobs = response.json()["choices"][0]["logprobs"]
        # Keyed by token text, as OpenAI's are: tokens decoding alike share an entry, so at most the vocabulary.
        assert len(logprobs["tokens"]) == 2 and all(20 < len(top) <= TINY_VOCAB for top in logprobs["top_logprobs"])
        streamed = _completion(client, logprobs=-1, stream=True)
        assert streamed.status_code == 200 and '"top_logprobs":[{' in streamed.text
        assert engine.requests[-1][2].logprobs == TINY_VOCAB
        # Scoring a prompt (echo, max_tokens 0): the prompt's logprobs over the vocabulary too.
        scored = _completion(client, logprobs=-1, echo=True, max_tokens=0)
        assert scored.status_code == 200, scored.text
        assert engine.requests[-1][2].prompt_logprobs == TINY_VOCAB


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_a_bound_one_short_of_the_vocabulary_refuses_minus_one(engine, tokenizer, path, body, param):
    with _client(engine, tokenizer, Limits(max_logprobs=TINY_VOCAB - 1)) as client:
        base = {"messages": CHAT} if path == "/v1/chat/completions" else {"prompt": "Hi there"}
        response = client.post(path, json={"model": MODEL, "max_tokens": 2, **base, **body})
        error = assert_openai_error(response, 400, "BadRequestError", param)
    assert f"at most {TINY_VOCAB - 1}" in error["message"] and "whole vocabulary" in error["message"]
    assert engine.requests == []


@pytest.mark.parametrize("body, param", [
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),  # the vocabulary (384) > 20
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),  # needs logprobs: true, as in vLLM
])
def test_chat_refusals_name_the_field(engine, tokenizer, body, param):
    with _client(engine, tokenizer, Limits()) as client:
        error = assert_openai_error(_chat(client, **body), 400, "BadRequestError", param)
    if body.get("top_logprobs") == -1 and body.get("logprobs"):
        assert "--max-logprobs" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"logprobs": -1}, "logprobs"),  # the vocabulary (384) > 20
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": -5}, "prompt_logprobs"),
    ({"logprobs": -2}, "logprobs"),
])
def test_completion_refusals_name_the_field(engine, tokenizer, body, param):
    with _client(engine, tokenizer, Limits(max_logprobs=20)) as client:
        error = assert_openai_error(_completion(client, **body), 400, "BadRequestError", param)
    if -1 in body.values():
        assert "--max-logprobs" in error["message"]
    with _client(engine, tokenizer, Limits(max_logprobs=-1)) as client:  # below -1: refused even uncapped
        assert_openai_error(_completion(client, logprobs=-2), 400, "BadRequestError", "logprobs")


# ---- through the real tiny engine (gRPC backend and HTTP frontend) -----------------------------


def _post(base_url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(base_url + path, data=json.dumps({"max_tokens": 2, **body}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("max_logprobs", [-1, 20])
def test_the_real_engine_serves_or_refuses_the_whole_vocabulary(tiny_checkpoint, max_logprobs):
    """-1 in each of the three counts over HTTP and gRPC, with the tiny Llama: every vocabulary token
    at every position when the server's bound allows it (-1), a 400 naming the field at vLLM's 20."""
    from backend.engine.async_llm_engine import AsyncLLMEngine
    from backend.types.config import EngineConfig

    limits = Limits(max_logprobs=max_logprobs)
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4,
                                         num_kv_blocks=64, max_model_len=64), limits)
    loop = LoopThread()
    try:
        with backend_and_frontend(loop, engine, limits) as (_server, _address, base_url):
            chat = {"messages": CHAT, "logprobs": True, "top_logprobs": -1, "prompt_logprobs": -1}
            completion = {"prompt": [5, 6, 7], "logprobs": -1, "prompt_logprobs": -1}
            chat_status, chat_body = _post(base_url, "/v1/chat/completions", chat)
            completion_status, completion_body = _post(base_url, "/v1/completions", completion)
    finally:
        engine.shutdown()
        loop.close()
    if max_logprobs == 20:
        assert (chat_status, chat_body["error"]["param"]) == (400, "top_logprobs")
        assert (completion_status, completion_body["error"]["param"]) == (400, "logprobs")
        return
    assert chat_status == 200 and completion_status == 200, (chat_body, completion_body)
    assert all(len(entry["top_logprobs"]) == TINY_VOCAB for entry in chat_body["choices"][0]["logprobs"]["content"])
    assert all(len(position) == TINY_VOCAB for position in chat_body["prompt_logprobs"][1:])
    assert [len(position) for position in completion_body["choices"][0]["prompt_logprobs"][1:]] == [TINY_VOCAB] * 2
    top = completion_body["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) == 2 and all(20 < len(alternatives) <= TINY_VOCAB for alternatives in top)
