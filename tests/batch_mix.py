"""The batch-mix fuzzer's machinery (the tests are tests/test_batch_mix_fuzzer.py).

``request_specs`` (a hypothesis strategy) draws requests that use every request feature the engine
has, each with an arrival step, an optional abort step and a client request ID (some hostile:
equal to the engine's own sequence IDs or the old derived forms, some reused while in flight).
``run_batch`` feeds them to one ``LLMEngine`` the way ``AsyncLLMEngine`` does (adds, aborts,
expired deadlines, then a step) and checks, on every batch:

- the engine never raises (a bad request is refused at ``add_request`` with a typed error);
- every request that was not aborted ends, each of its ``n`` sequences with a finish reason or
  the request with a clean error; outputs obey max_tokens, min_tokens, the vocabulary, logprobs;
- a constrained request that stopped produced text its constraint accepts;
- afterwards the engine is idle: no running or waiting sequence, every KV block free, no
  grammar matcher, beam search or request bookkeeping left.

``assert_same_as_alone`` then runs each deterministic request (greedy, beam search) alone on the
same engine and checks its tokens equal the batched ones (the caller does this in fp32 only).

When you add a request feature, add it to ``request_specs`` (and a check to ``_check_request``).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Optional

from hypothesis import strategies as st

from backend.engine.llm_engine import LLMEngine
from backend.engine.stream_interval import DeltaCoalescer
from backend.types.errors import InvalidRequestError, RequestFailedError
from backend.types.outputs import FinishReason
from backend.types.pooling import PoolingParams
from backend.types.sampling_params import SamplingParams
from frontend.tool_calls import constrained_tool_schema

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 3}},
    "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]

# Constraint kind -> (structured_outputs, a check of the finished text). Bounded languages, so a
# random model finishes them within max_tokens most of the time.
CONSTRAINTS = {
    "json": ({"json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
              "disable_any_whitespace": True}, lambda text: json.loads(text).keys() == {"ok"}),
    "json_object": ({"json_object": True, "disable_any_whitespace": True},
                    lambda text: isinstance(json.loads(text), dict)),
    "regex": ({"regex": r"[0-9]{2}-[a-z]"}, lambda text: re.fullmatch(r"[0-9]{2}-[a-z]", text) is not None),
    "choice": ({"choice": ["Paris", "Lyon", "Nice"]}, lambda text: text in ("Paris", "Lyon", "Nice")),
    "grammar": ({"grammar": 'root ::= "yes" | "no" | "maybe"'}, lambda text: text in ("yes", "no", "maybe")),
    "tools_required": ({"json": constrained_tool_schema(TOOLS, None, parallel=False), "disable_any_whitespace": True},
                       lambda text: len(json.loads(text)) == 1),
    "tool_named": ({"json": constrained_tool_schema(TOOLS, "get_weather", parallel=False),
                    "disable_any_whitespace": True},
                   lambda text: json.loads(text)["city"] in ("Paris", "Oslo")),
}

# Client request IDs a hostile client would pick: the engine's own sequence IDs, and the forms
# children of ``n`` and beams once had.
HOSTILE_IDS = ["seq-0", "seq-1", "seq-2", "seq-7", "r0#0", "r0#1", "r1#beam1.0", "r0", "r1"]
# Shared prompt heads: requests that start with one hit the prefix cache (block size 4).
PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7, 8, 9, 10]]


@dataclass
class RequestSpec:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    constraint: Optional[str] = None  # a CONSTRAINTS key
    arrival_step: int = 0
    abort_step: Optional[int] = None  # the client aborts it then (if still running)
    expired: bool = False  # its deadline has passed when it arrives
    cache_salt: Optional[str] = None

    @property
    def deterministic(self) -> bool:
        """Its tokens depend on nothing but the model and its inputs: greedy or beam search."""
        return self.params.use_beam_search or self.params.greedy


@dataclass
class Outcome:
    """What one added request got: per index its tokens (and logprob positions), finish reason."""

    spec: RequestSpec
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    finish: dict[int, FinishReason] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)
    pooled: dict[int, list[float]] = field(default_factory=dict)  # embeddings (SamplingParams.pooling)
    error: Optional[str] = None  # a RequestFailedError or InvalidRequestError, at add or later
    aborted: bool = False  # by the client (the fuzzer)
    # With a stream interval: the deltas as a served stream regroups them, and their tokens per index.
    coalescer: Optional[DeltaCoalescer] = None
    grouped: dict[int, list[int]] = field(default_factory=dict)


_EMBED_SALTS = itertools.count()  # across batches too: the engine (and its prefix cache) outlives a batch


@st.composite
def sampling_params(draw, vocab_size: int, max_model_len: int) -> tuple[SamplingParams, Optional[str]]:
    """Sampling parameters mixing every feature, and the constraint kind (or None)."""
    if draw(st.integers(0, 11)) == 0:  # an embedding (AsyncLLMEngine.embed's request): prompt, one token, end
        return SamplingParams(max_tokens=1, temperature=0.0, pooling=PoolingParams(
            draw(st.sampled_from(["last", "mean"])), draw(st.booleans()))), None
    if draw(st.integers(0, 9)) == 0:  # beam search takes only a few parameters
        return SamplingParams(use_beam_search=True, n=draw(st.integers(1, 3)),
                              max_tokens=draw(st.integers(1, 5)),
                              length_penalty=draw(st.sampled_from([0.5, 1.0, 1.5])),
                              stop_token_ids=draw(st.lists(st.integers(0, vocab_size - 1), max_size=2)),
                              logprobs=draw(st.sampled_from([None, 0])),
                              ignore_eos=draw(st.booleans())), None
    constraint = draw(st.one_of(st.none(), st.none(), st.sampled_from(sorted(CONSTRAINTS))))
    greedy = draw(st.booleans())
    max_tokens = draw(st.one_of(st.integers(1, 24), st.just(None)))
    min_tokens = draw(st.integers(0, min(4, max_tokens or 4)))
    logprobs_kind = draw(st.sampled_from(["none", "none", "top", "ids"]))
    params = dict(
        n=draw(st.sampled_from([1, 1, 1, 2, 3])),
        temperature=0.0 if greedy else draw(st.sampled_from([0.5, 1.0, 1.3])),
        top_p=1.0 if greedy else draw(st.sampled_from([1.0, 0.9, 0.5])),
        top_k=0 if greedy else draw(st.sampled_from([0, 1, 5, 50])),
        min_p=0.0 if greedy else draw(st.sampled_from([0.0, 0.05])),
        seed=None if greedy else draw(st.one_of(st.none(), st.integers(0, 2 ** 31))),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.5, -1.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.7])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.2, 0.9])),
        max_tokens=max_tokens if constraint is None else max(max_tokens or 40, 40),
        min_tokens=min_tokens if constraint is None else 0,
        stop_token_ids=draw(st.lists(st.integers(0, vocab_size - 1), max_size=3)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.integers(0, 4)) if logprobs_kind == "top" else None,
        logprob_token_ids=draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=3))
        if logprobs_kind == "ids" else None,
        prompt_logprobs=draw(st.one_of(st.none(), st.none(), st.integers(0, 3))),
        structured_outputs=CONSTRAINTS[constraint][0] if constraint else None,
        logit_bias=draw(st.one_of(st.none(), st.none(), st.dictionaries(
            st.integers(0, vocab_size - 1), st.sampled_from([-100.0, -100.0, -3.5, 2.0, 100.0]), min_size=1,
            max_size=3))),
    )
    return SamplingParams(**params), constraint


@st.composite
def request_specs(draw, vocab_size: int, max_model_len: int, max_requests: int = 8) -> list[RequestSpec]:
    """A batch: up to ``max_requests`` requests arriving over the first steps."""
    specs = []
    for i in range(draw(st.integers(1, max_requests))):
        params, constraint = draw(sampling_params(vocab_size, max_model_len))
        head = draw(st.one_of(st.just([]), st.sampled_from(PREFIXES)))
        tail = draw(st.lists(st.integers(3, vocab_size - 1), min_size=0 if head else 1, max_size=24))
        prompt = (head + tail)[:max_model_len - 2]
        request_id = draw(st.one_of(st.just(f"r{i}"), st.just(f"r{i}"), st.sampled_from(HOSTILE_IDS)))
        arrival = draw(st.integers(0, 6))
        abort = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(arrival, arrival + 12)))
        salt = draw(st.sampled_from([None, None, None, "tenant-a"]))
        if params.pooling is not None and params.pooling.type == "mean":
            salt = f"embed-{next(_EMBED_SALTS)}"  # unique, as embed()'s: every position computed, no cache hit
        specs.append(RequestSpec(request_id, prompt, params, constraint, arrival, abort,
                                 expired=draw(st.integers(0, 19)) == 0, cache_salt=salt))
    return specs


def run_batch(engine: LLMEngine, specs: list[RequestSpec], max_steps: int = 3000,
              stream_interval: int = 1) -> list[Outcome]:
    """Run ``specs`` on ``engine`` until it is idle; check every invariant; the outcomes. With
    ``stream_interval`` > 1 each request's deltas also go through a served stream's regrouping
    (``DeltaCoalescer``), whose tokens must be the engine's, sequence by sequence, at each end."""
    outcomes: list[Outcome] = []
    live: dict[str, Outcome] = {}  # client ID -> the request that holds it now
    step = 0
    while step < max_steps:
        for spec in (s for s in specs if s.arrival_step == step):
            outcome = Outcome(spec)
            if stream_interval > 1:
                outcome.coalescer = DeltaCoalescer(stream_interval)
            outcomes.append(outcome)
            deadline = time.monotonic() - 1.0 if spec.expired else None
            try:
                engine.add_request(spec.request_id, spec.prompt, spec.params, deadline=deadline,
                                   cache_salt=spec.cache_salt)
            except (InvalidRequestError, RequestFailedError) as error:  # refused, cleanly
                assert spec.request_id in live or isinstance(error, RequestFailedError), error
                outcome.error = str(error)
                continue
            live[spec.request_id] = outcome
        aborts = [rid for rid, o in live.items() if o.spec.abort_step == step]
        for request_id in aborts:
            live.pop(request_id).aborted = True
        engine.abort_request(aborts)
        outputs = engine.abort_expired()
        if engine.has_unfinished_requests():
            outputs += engine.step()
        for out in outputs:
            outcome = live.get(out.request_id)
            assert outcome is not None, f"an output for {out.request_id!r}, which is not in flight"
            assert 0 <= out.index < outcome.spec.params.n and out.index not in outcome.finish
            outcome.tokens.setdefault(out.index, []).extend(out.new_token_ids)
            if out.new_logprobs is not None:
                outcome.logprobs.setdefault(out.index, []).extend(out.new_logprobs)
            if out.prompt_logprobs is not None:
                outcome.prompt_logprobs[out.index] = out.prompt_logprobs
            if out.pooled is not None:
                outcome.pooled[out.index] = out.pooled
            if out.error is not None:
                outcome.error = out.error
            if outcome.coalescer is not None:
                _check_grouped(outcome, outcome.coalescer.push(out), stream_interval)
            if out.finish_reason is not None:
                outcome.finish[out.index] = out.finish_reason
                if len(outcome.finish) == outcome.spec.params.n:
                    del live[out.request_id]
        step += 1
        if not live and all(s.arrival_step < step for s in specs) and not engine.has_unfinished_requests():
            break
    assert not live, f"requests never finished: {sorted(live)}"
    assert_idle(engine)
    for outcome in outcomes:
        _check_request(engine, outcome)
    return outcomes


def _check_grouped(outcome: Outcome, grouped, interval: int) -> None:
    """A regrouped delta: held ones carry fewer than ``interval`` tokens; at a sequence's end every
    token the engine sent has gone out, in order."""
    if grouped is None:
        return
    tokens = outcome.grouped.setdefault(grouped.index, [])
    if tokens and grouped.new_token_ids and grouped.finish_reason is None and grouped.error is None:
        assert len(grouped.new_token_ids) >= interval, "a regrouped delta went out short before its end"
    tokens.extend(grouped.new_token_ids)
    if grouped.finish_reason is not None or grouped.error is not None:
        assert tokens == outcome.tokens.get(grouped.index, []), "the regrouped stream lost or reordered tokens"


def assert_idle(engine: LLMEngine) -> None:
    scheduler, blocks = engine.scheduler, engine.block_manager
    assert not engine.has_unfinished_requests()
    assert scheduler.num_running == scheduler.num_waiting == 0 and not scheduler.requests
    assert blocks.num_free_blocks == blocks.num_blocks, "KV blocks leaked"
    assert not engine.children and not engine.beams, "request bookkeeping leaked"
    assert not engine.structured_output.has_matchers, "grammar matchers leaked"


def _check_request(engine: LLMEngine, outcome: Outcome) -> None:
    spec, params = outcome.spec, outcome.spec.params
    if outcome.aborted or (outcome.error is not None and not outcome.finish):
        return
    assert sorted(outcome.finish) == list(range(params.n)), (spec, outcome.finish)
    if spec.expired:
        assert set(outcome.finish.values()) == {FinishReason.ABORT}
        return
    assert outcome.error is None, f"{spec}: {outcome.error}"  # nothing in these batches may fail
    for index, reason in outcome.finish.items():
        tokens = outcome.tokens.get(index, [])
        assert all(0 <= t < engine.vocab_size for t in tokens)
        if params.max_tokens is not None:
            assert len(tokens) <= params.max_tokens
        if reason == FinishReason.STOP and not params.use_beam_search:
            assert len(tokens) >= params.min_tokens
            if spec.constraint is not None and tokens and tokens[-1] in engine.eos_token_ids:
                text = engine_text(engine, tokens)
                assert CONSTRAINTS[spec.constraint][1](text), (spec.constraint, text)
        if reason == FinishReason.ABORT:  # only a grammar left with no allowed token ends so
            assert spec.constraint is not None, spec
        if params.wants_logprobs and not params.use_beam_search:
            positions = outcome.logprobs.get(index, [])
            assert len(positions) == len(tokens)
            assert all(next(iter(p)) == t for p, t in zip(positions, tokens))  # the chosen token first
            if params.logprob_token_ids:
                assert all(set(params.logprob_token_ids) <= set(p) for p in positions)
        if params.prompt_logprobs is not None and tokens:
            assert len(outcome.prompt_logprobs[index]) == len(spec.prompt)
        if params.logit_bias and spec.constraint is None:
            _check_logit_bias(engine, params, tokens)
        if params.pooling is not None:  # one vector of the hidden size, finite, unit length if normalized
            vector = outcome.pooled[index]
            assert len(vector) == engine.config.hf_config.hidden_size and all(math.isfinite(x) for x in vector)
            if params.pooling.normalize:
                assert abs(math.fsum(x * x for x in vector) - 1.0) < 1e-3


def _check_logit_bias(engine: LLMEngine, params: SamplingParams, tokens: list[int]) -> None:
    """-100 forbids a token; +100 forces one (unless min_tokens masks the forced ones: stop IDs)."""
    forbidden = {t for t, b in params.logit_bias.items() if b == -100.0}
    forced = {t for t, b in params.logit_bias.items() if b == 100.0}
    assert not forbidden & set(tokens) - forced, (params.logit_bias, tokens)
    stops = set(params.stop_token_ids) | set(engine.eos_token_ids)
    if forced and not forced & stops:
        assert set(tokens) <= forced, (params.logit_bias, tokens)


_TOKENIZERS: dict = {}


def engine_text(engine: LLMEngine, token_ids: list[int]) -> str:
    from transformers import PreTrainedTokenizerFast

    path = str(engine.config.tokenizer_path)
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = PreTrainedTokenizerFast.from_pretrained(path)
    return _TOKENIZERS[path].decode(token_ids, skip_special_tokens=True)


def assert_same_as_alone(engine: LLMEngine, outcomes: list[Outcome]) -> int:
    """Run each deterministic request that finished alone on ``engine``; its tokens must equal the
    batched ones. Returns how many were compared."""
    compared = 0
    for outcome in outcomes:
        spec = outcome.spec
        if not spec.deterministic or outcome.aborted or outcome.error or spec.expired:
            continue
        salt = spec.cache_salt
        if spec.params.pooling is not None and spec.params.pooling.type == "mean":
            salt = f"embed-{next(_EMBED_SALTS)}"  # the batched run's blocks would be a prefix hit
        alone_spec = RequestSpec("alone", spec.prompt, spec.params, spec.constraint, cache_salt=salt)
        [alone] = run_batch(engine, [alone_spec])
        assert alone.tokens == outcome.tokens, (spec, outcome.tokens, alone.tokens)
        assert alone.finish == outcome.finish
        for index, vector in outcome.pooled.items():  # an embedding: the same vector, batched or alone
            assert max(abs(a - b) for a, b in zip(vector, alone.pooled[index])) < 1e-3, spec
        compared += 1
    return compared
