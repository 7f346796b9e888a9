"""No request, alone or in any batch, can kill the engine.

Regression tests for the two ordinary requests that once did (a structured-output request batched
with a free one on bf16; a client request ID equal to an engine-internal sequence ID), and for the
rule behind both: a failure that belongs to one request (its grammar, sampling, logprobs, drafts)
ends that request with a clear error while the engine and every other request go on.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.engine.llm_engine import LLMEngine
from backend.types.config import EngineConfig
from backend.types.errors import RequestFailedError
from backend.types.outputs import FinishReason
from backend.types.sampling_params import SamplingParams
from backend.worker import sampler as sampler_module

pytestmark = pytest.mark.timeout(300)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
          "required": ["ok", "n"]}
SPECS = {
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "json_object": {"json_object": True, "disable_any_whitespace": True},
    "regex": {"regex": r"[0-9]{2}-[a-z]{2}"},
    "choice": {"choice": ["Paris", "Lyon"]},
    "grammar": {"grammar": 'root ::= "yes" | "no"'},
}
PROMPT = [5, 6, 7, 8, 9, 10]


def make_engine(model_dir, dtype: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, block_size=4, num_kv_blocks=256,
                                  max_model_len=128, **kwargs))


def drain(engine: LLMEngine, max_steps: int = 2000) -> dict:
    """Step until idle: client ID -> {index: [tokens, finish reason, error]}."""
    results: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            entry = results.setdefault(out.request_id, {}).setdefault(out.index, [[], None, None])
            entry[0] += out.new_token_ids
            entry[1], entry[2] = out.finish_reason or entry[1], out.error or entry[2]
    assert not engine.has_unfinished_requests(), "the engine did not drain"
    return results


def assert_idle(engine: LLMEngine) -> None:
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.children and not engine.beams and not engine.structured_output.has_matchers


def decode(engine: LLMEngine, token_ids: list[int]) -> str:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(engine.config.tokenizer_path))
    return tokenizer.decode(token_ids, skip_special_tokens=True)


# ---- killer 1: a grammar mask batched with free rows, in every dtype ------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_structured_outputs_of_every_kind_batched_with_free_n_and_beam_requests(tiny_checkpoint, dtype):
    engine = make_engine(tiny_checkpoint("llama"), dtype)
    try:
        for kind, spec in SPECS.items():
            engine.add_request(kind, PROMPT, SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=spec))
        engine.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
        engine.add_request("n", PROMPT, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, logprobs=2))
        engine.add_request("n-json", PROMPT, SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=30,
                                                            structured_outputs=SPECS["choice"]))
        engine.add_request("beam", PROMPT, SamplingParams(use_beam_search=True, n=2, max_tokens=4))
        results = drain(engine)
        assert not any(seq[2] for seqs in results.values() for seq in seqs.values())  # no errors
        texts = {kind: decode(engine, results[kind][0][0]) for kind in SPECS}
        assert json.loads(texts["json"]).keys() == {"ok", "n"}
        if results["json_object"][0][1] == FinishReason.STOP:  # a random model may write one long key
            assert isinstance(json.loads(texts["json_object"]), dict)
        assert texts["json_object"].startswith("{")
        assert re.fullmatch(r"[0-9]{2}-[a-z]{2}", texts["regex"])
        assert texts["choice"] in ("Paris", "Lyon") and texts["grammar"] in ("yes", "no")
        assert all(decode(engine, results["n-json"][i][0]) in ("Paris", "Lyon") for i in (0, 1))
        assert len(results["free"][0][0]) == 8 and len(results["beam"]) == 2
        assert_idle(engine)
    finally:
        engine.shutdown()


# ---- killer 2: client IDs equal to internal ones ------------------------------------------------


def test_client_ids_that_look_like_internal_ids_never_collide(tiny_checkpoint):
    """The engine keys its sequences with IDs of its own: a client ID equal to one is just a label."""
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4,
                                         num_kv_blocks=256, max_model_len=128))

    async def collect(request_id, params):
        got: dict = {}
        async for out in engine.generate(request_id, PROMPT, params):
            got.setdefault(out.index, []).extend(out.new_token_ids)
        return request_id, got

    async def scenario():
        # The first request's sequences are the engine's first: their internal IDs are the ones
        # a hostile client would guess; the others use them, and the old "{id}#{i}" forms.
        first = asyncio.ensure_future(collect("v1", SamplingParams(n=2, temperature=0.0, max_tokens=12)))
        await asyncio.sleep(0)
        hostile = ["v1#0", "v1#1", "seq-0", "seq-1", "seq-2", "v1#beam1.0", "b#beam1.0"]
        others = [collect(rid, SamplingParams(temperature=0.0, max_tokens=6)) for rid in hostile]
        others.append(collect("b", SamplingParams(use_beam_search=True, n=2, max_tokens=3)))
        return dict(await asyncio.gather(first, *others))

    try:
        results = asyncio.run(scenario())
        assert len(results["v1"]) == 2 and all(len(t) == 12 for t in results["v1"].values())
        alone = results["seq-0"][0]
        assert all(results[rid][0] == alone for rid in ("v1#0", "v1#1", "seq-1", "seq-2", "v1#beam1.0"))
        assert results["v1"][0][:6] == alone  # greedy: the same prompt gives the same tokens
        assert len(results["b"]) == 2
        assert engine.dead_error is None
        assert_idle(engine.engine)
    finally:
        engine.shutdown()


# ---- failures stay with their request -------------------------------------------------------------


POISON_PENALTY = 1.2345  # a repetition penalty the patched sampler refuses


@pytest.fixture
def poisoned_penalties(monkeypatch):
    """The sampler's penalties raise for a row with POISON_PENALTY (a stand-in for any bug that
    one request's parameters reach), on every path: a batch with random rows (_apply_penalties)
    and a greedy one (_penalty_args, before the fused penalized argmax)."""
    def poison(function):
        def poisoned(*args):
            rows, row_indices = (args[1], args[2]) if function is apply else (args[0], args[1])
            if any(rows[i].params.repetition_penalty == POISON_PENALTY for i in row_indices):
                raise RuntimeError("injected sampler failure")
            return function(*args)
        return poisoned

    apply = sampler_module._apply_penalties
    monkeypatch.setattr(sampler_module, "_apply_penalties", poison(apply))
    monkeypatch.setattr(sampler_module, "_penalty_args", poison(sampler_module._penalty_args))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_whose_sampling_raises_ends_alone_with_an_error(tiny_checkpoint, poisoned_penalties, dtype):
    engine = make_engine(tiny_checkpoint("llama"), dtype)
    try:
        engine.add_request("alone", PROMPT, SamplingParams(temperature=0.0, max_tokens=10,
                                                           repetition_penalty=1.1))
        alone = drain(engine)["alone"][0][0]
        engine.add_request("bad", PROMPT, SamplingParams(n=2, temperature=0.0, max_tokens=10,
                                                         repetition_penalty=POISON_PENALTY))
        engine.add_request("good", PROMPT, SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.1))
        engine.add_request("free", PROMPT, SamplingParams(temperature=0.8, seed=1, max_tokens=10, logprobs=1))
        results = drain(engine)
        assert {i: (r[1], "injected sampler failure" in r[2]) for i, r in results["bad"].items()} == \
            {0: (FinishReason.ABORT, True), 1: (FinishReason.ABORT, True)}
        assert results["good"][0][0] == alone and results["good"][0][2] is None
        assert len(results["free"][0][0]) == 10 and results["free"][0][2] is None
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_a_request_whose_grammar_raises_ends_alone_with_an_error(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("llama"), "float32")
    manager = engine.structured_output
    add = manager.add

    class BrokenMatcher:
        def fill_next_token_bitmask(self, bitmask, row):
            raise RuntimeError("injected grammar failure")

    def add_breaking_one(request_id, compiled):  # the sequences of client request "broken" break
        add(request_id, compiled)
        if request_id in engine.children.get("broken", ()):
            manager._matchers[request_id] = BrokenMatcher()

    manager.add = add_breaking_one
    try:
        engine.add_request("alone", PROMPT, SamplingParams(temperature=0.0, max_tokens=30,
                                                           structured_outputs=SPECS["json"]))
        alone = drain(engine)["alone"][0][0]
        engine.add_request("broken", PROMPT, SamplingParams(temperature=0.0, max_tokens=30,
                                                            structured_outputs=SPECS["regex"]))
        engine.add_request("good", PROMPT, SamplingParams(temperature=0.0, max_tokens=30,
                                                          structured_outputs=SPECS["json"]))
        results = drain(engine)
        assert results["broken"][0][1] == FinishReason.ABORT
        assert "injected grammar failure" in results["broken"][0][2]
        assert results["good"][0][0] == alone and results["good"][0][2] is None
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_async_engine_raises_request_failed_for_that_request_only(tiny_checkpoint, poisoned_penalties):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4,
                                         num_kv_blocks=256, max_model_len=128))

    async def run(request_id, params):
        tokens = []
        try:
            async for out in engine.generate(request_id, PROMPT, params):
                tokens += out.new_token_ids
        except RequestFailedError as error:
            return error
        return tokens

    async def scenario():
        return await asyncio.gather(
            run("bad", SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=POISON_PENALTY)),
            run("good", SamplingParams(temperature=0.0, max_tokens=10)))

    try:
        bad, good = asyncio.run(scenario())
        assert isinstance(bad, RequestFailedError) and "injected sampler failure" in str(bad)
        assert isinstance(good, list) and len(good) == 10
        assert engine.dead_error is None
        again = asyncio.run(run("after", SamplingParams(temperature=0.0, max_tokens=10)))
        assert again == good  # the engine serves on, unchanged
    finally:
        engine.shutdown()


@pytest.mark.timeout(180)
def test_a_failed_request_is_a_500_over_http_and_grpc_while_the_server_serves_on(tiny_checkpoint, poisoned_penalties):
    import grpc
    import httpx
    from helpers import LoopThread, backend_and_frontend

    from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

    loop = LoopThread()
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4,
                                         num_kv_blocks=128, max_model_len=128))
    bad = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "repetition_penalty": POISON_PENALTY}
    good = {"prompt": "Hello", "max_tokens": 8, "temperature": 0}
    try:
        with backend_and_frontend(loop, engine) as (_, address, base_url), \
                httpx.Client(base_url=base_url, timeout=60) as http, grpc.insecure_channel(address) as channel:
            response = http.post("/v1/completions", json=bad)
            assert response.status_code == 500, response.text
            assert "injected sampler failure" in response.json()["error"]["message"]
            with http.stream("POST", "/v1/completions", json={**bad, "stream": True}) as stream:
                body = "".join(stream.iter_text())
            assert "injected sampler failure" in body and "data: [DONE]" not in body.split("error")[0]
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(engine_pb2.GenerateRequest(
                    request_id="bad-grpc", prompt_token_ids=[5, 6, 7], sampling_params=engine_pb2.SamplingParams(
                        max_tokens=4, temperature=0.0, repetition_penalty=POISON_PENALTY)), timeout=60))
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "injected sampler failure" in info.value.details()
            response = http.post("/v1/completions", json=good)
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
            assert http.get("/health").status_code == 200 and engine.dead_error is None
    finally:
        engine.shutdown()
        loop.close()


def test_a_beam_search_past_its_deadline_ends_with_abort(tiny_checkpoint):
    import time

    engine = make_engine(tiny_checkpoint("llama"), "float32")
    try:
        engine.add_request("beam", PROMPT, SamplingParams(use_beam_search=True, n=2, max_tokens=20),
                           deadline=time.monotonic() + 3600)
        engine.step()
        expired = engine.abort_expired(time.monotonic() + 7200)
        assert sorted((o.request_id, o.index, o.finish_reason) for o in expired) == \
            [("beam", 0, FinishReason.ABORT), ("beam", 1, FinishReason.ABORT)]
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_prompt_logprobs_survive_a_preemption_whose_recompute_chunks_differ():
    """Found by the fuzzer: a prompt computed in a 3-token chunk, preempted, then computed again
    in one 8-token chunk kept only its first 3 logprobs (the new chunk overlapped the old)."""
    from backend.core.request import Request
    from backend.types.outputs import Logprob

    request = Request("seq-x", list(range(10, 18)), SamplingParams(prompt_logprobs=0), None)
    first = [{11 + i: Logprob(-1.0 - i)} for i in range(3)]  # tokens 1..3
    again = [{11 + i: Logprob(-1.0 - i)} for i in range(7)]  # tokens 1..7, after the preemption
    request.record_prompt_logprobs(1, first)
    request.record_prompt_logprobs(1, again)
    assert request.prompt_logprobs == [None] + again
    request.record_prompt_logprobs(4, again[3:])  # a chunk wholly known: nothing added
    assert len(request.prompt_logprobs) == 8
