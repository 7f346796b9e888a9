"""Structured outputs in the backend: the token mask, grammar compilation, enforcement in the engine.

A tiny random Llama generates unconstrained garbage, so any valid output is the
constraint's doing. Schemas are bounded (no free strings) so greedy runs end.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest
import torch

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.engine.llm_engine import LLMEngine
from backend.messages.grammar_mask import GrammarBitmask, TokenBitmask
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.outputs import FinishReason
from backend.types.sampling_params import MAX_STRUCTURED_OUTPUT_CHARS, SamplingParams, StructuredOutputsParams

BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "size", "n"],
}


@pytest.fixture(scope="module")
def engine(tiny_llama_engine):
    return tiny_llama_engine


def run(engine: LLMEngine, requests: dict[str, SamplingParams], prompt=(5, 6, 7, 8)) -> dict:
    """request ID -> {index: (token IDs, finish reason)}."""
    for request_id, params in requests.items():
        engine.add_request(request_id, list(prompt), params)
    results: dict = {rid: {} for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, _ = results[out.request_id].get(out.index, ([], None))
            results[out.request_id][out.index] = (tokens + out.new_token_ids, out.finish_reason)
    return results


def text(engine: LLMEngine, token_ids: list[int]) -> str:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(engine.config.tokenizer_path))
    return tokenizer.decode(token_ids, skip_special_tokens=True)


# ---- the mask -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("constrained_rows", [(0, 2), (0, 1, 2)])  # some rows (index_add_), all rows (add_)
@pytest.mark.parametrize("vocab_size", [64, 100])  # a multiple of 32 and not
def test_bitmask_sets_exactly_the_disallowed_logits_to_minus_inf(vocab_size, constrained_rows, dtype):
    torch.manual_seed(0)
    width = -(-vocab_size // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(constrained_rows), width), dtype=torch.int32)
    logits = torch.randn(3, vocab_size).to(dtype)
    expected = logits.clone()
    for k, row in enumerate(constrained_rows):  # the other rows are free
        for token in range(vocab_size):
            if not (int(bitmask[k, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    TokenBitmask(bitmask, torch.tensor(constrained_rows)).apply_(logits)
    assert logits.dtype == dtype and torch.equal(logits, expected)


def test_grammar_bitmask_picks_the_rows_of_the_sampler():
    bitmask = torch.tensor([[1], [2]], dtype=torch.int32)
    grammar = GrammarBitmask(bitmask, {"a": 0, "b": 1})
    picked = grammar.for_sampler_rows(["x", "b", "a"])
    assert picked.rows.tolist() == [1, 2] and picked.bitmask.tolist() == [[2], [1]]
    assert grammar.for_sampler_rows(["x", "y"]) is None


# ---- the parameters -----------------------------------------------------------------------


@pytest.mark.parametrize("spec, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"regex": "a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)}, "at most"),
    ({"regex": "a", "whitespace_pattern": " "}, "does not take whitespace_pattern"),
])
def test_bad_structured_outputs_params_name_the_parameter(spec, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        SamplingParams(structured_outputs=spec)
    assert error.value.param == "structured_outputs"


@pytest.mark.parametrize("spec", [
    {"json": '{"type": "nonsense"}'}, {"regex": "(unclosed"}, {"grammar": "root ::= undefined_rule"},
])
def test_a_spec_that_does_not_compile_is_refused_before_it_runs(engine, spec):
    with pytest.raises(InvalidRequestError, match="Invalid structured_outputs") as error:
        engine.add_request("bad", [1, 2], SamplingParams(structured_outputs=spec))
    assert error.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests()


# ---- enforcement --------------------------------------------------------------------------


def test_every_kind_of_constraint_is_obeyed(engine):
    specs = {
        "json": {"json": BOUNDED_SCHEMA, "disable_any_whitespace": True},
        "object": {"json_object": True, "disable_any_whitespace": True},
        "regex": {"regex": r"[0-9]{3}-[a-z]{2}"},
        "choice": {"choice": ["Paris", "Lyon", "Nice café"]},
        "grammar": {"grammar": 'root ::= "ab" ("c" | "d") "!"'},
    }
    results = run(engine, {rid: SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec)
                           for rid, spec in specs.items()} | {"free": SamplingParams(temperature=0.0, max_tokens=8)})
    outputs = {rid: text(engine, seqs[0][0]) for rid, seqs in results.items()}
    document = json.loads(outputs["json"])
    assert set(document) == {"ok", "size", "n"} and isinstance(document["ok"], bool)
    assert document["size"] in ("S", "M", "L") and 0 <= document["n"] <= 9
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outputs["regex"])
    assert outputs["choice"] in ("Paris", "Lyon", "Nice café")
    assert re.fullmatch(r"ab[cd]!", outputs["grammar"])
    for rid in ("regex", "choice", "grammar"):  # the grammar ended, so the sequence did
        assert results[rid][0][1] == FinishReason.STOP
    # The unconstrained request in the same batches got what it gets alone.
    alone = run(engine, {"alone": SamplingParams(temperature=0.0, max_tokens=8)})
    assert results["free"][0][0] == alone["alone"][0][0]
    assert not engine.structured_output.has_matchers  # finished sequences dropped theirs


def test_each_sampled_sequence_has_its_own_grammar_state(engine):
    params = SamplingParams(n=3, temperature=1.5, seed=1, max_tokens=20,
                            structured_outputs={"regex": r"(yes|no)+ ok"})
    sequences = run(engine, {"n": params})["n"]
    finished = [text(engine, tokens) for tokens, reason in sequences.values() if reason == FinishReason.STOP]
    unfinished = [text(engine, tokens) for tokens, reason in sequences.values() if reason != FinishReason.STOP]
    assert finished and all(re.fullmatch(r"(yes|no)+ ok", t) for t in finished)
    assert all(re.fullmatch(r"(yes|no)*(y|ye|n|yes ?|no ?|yes o|no o)?", t) for t in unfinished)
    assert len(set(finished + unfinished)) > 1  # the sequences went their own ways


def test_a_complete_grammar_ends_the_sequence_even_with_ignore_eos(engine):
    results = run(engine, {"e": SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                               structured_outputs={"choice": ["done"]})})
    tokens, reason = results["e"][0]
    assert reason == FinishReason.STOP and text(engine, tokens) == "done"


def test_async_engine_compiles_on_the_grammar_thread_and_reports_errors_first(tiny_checkpoint, monkeypatch):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32",
                                         num_kv_blocks=64, max_model_len=128))
    compiler = engine.engine.structured_output.compiler
    threads = []
    original = compiler._compile_bounded

    def recording_compile(*args):
        threads.append(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(compiler, "_compile_bounded", recording_compile)

    async def scenario():
        outs = [o async for o in engine.generate("a", [1, 2, 3], SamplingParams(
            temperature=0.0, max_tokens=10, structured_outputs={"choice": ["x1", "y2"]}))]
        with pytest.raises(InvalidRequestError, match="Invalid structured_outputs"):
            async for _ in engine.generate("b", [1, 2, 3], SamplingParams(structured_outputs={"regex": "("})):
                pass
        return outs

    try:
        outs = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert threads and all(name.startswith("tandem-grammar") for name in threads)
    assert outs[-1].finish_reason == FinishReason.STOP


def test_structured_outputs_params_accept_vllm_dict_and_schema_dict():
    params = SamplingParams(structured_outputs={"json": {"type": "object"}})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert json.loads(params.structured_outputs.json) == {"type": "object"}
    assert params.structured_outputs.kind == "json"


def test_bounded_strings_never_hold_control_characters(engine):
    """Strict JSON forbids a raw tab in a string; xgrammar's minLength/maxLength rule alone allows it."""
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(engine.config.tokenizer_path))
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}
    compiled = engine.structured_output.compile(StructuredOutputsParams(json=schema))

    def accepts(text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled)
        return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert accepts('{"s": "ab c"}') and not accepts('{"s": "a\tb"}') and not accepts('{"s": "abcde"}')


def test_speculative_decoding_leaves_constrained_and_beam_sequences_undrafted(tiny_checkpoint):
    """With n-gram drafts on, constrained and beam-search sequences get none (their mask and
    candidates cover one position per step) while free sequences do, and every constraint holds."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4,
                                    num_kv_blocks=256, max_model_len=256,
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                        "prompt_lookup_max": 3}))
    drafted: dict[str, int] = {}
    execute = engine.executor.execute_model

    def recording_execute(sched):  # by client request ID ("beam" for all its children)
        for s in sched.scheduled:
            client_id = engine.scheduler.requests[s.request_id].parent_id
            drafted[client_id] = drafted.get(client_id, 0) + s.num_draft_tokens
        return execute(sched)

    engine.executor.execute_model = recording_execute
    specs = {"json": {"json": BOUNDED_SCHEMA, "disable_any_whitespace": True},
             "regex": {"regex": r"([0-9]{2}-)+[a-z]{2}"}, "choice": {"choice": ["Paris", "Lyon"]}}
    requests = {rid: SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec)
                for rid, spec in specs.items()}
    requests["free"] = SamplingParams(temperature=0.0, max_tokens=24)
    requests["beam"] = SamplingParams(use_beam_search=True, n=2, max_tokens=6)
    try:
        results = run(engine, requests, prompt=[5, 6, 7, 8, 9] * 4)  # repetitive: lookups find matches
        outputs = {rid: text(engine, seqs[0][0]) for rid, seqs in results.items()}
    finally:
        engine.shutdown()
    document = json.loads(outputs["json"])
    assert set(document) == {"ok", "size", "n"} and 0 <= document["n"] <= 9
    assert re.fullmatch(r"([0-9]{2}-)+[a-z]{2}", outputs["regex"])
    assert outputs["choice"] in ("Paris", "Lyon")
    assert all(results[rid][0][1] == FinishReason.STOP for rid in specs)
    assert drafted["free"] > 0  # speculation was on
    assert all(drafted[rid] == 0 for rid in specs)
    assert drafted["beam"] == 0
    assert len(results["beam"]) == 2
