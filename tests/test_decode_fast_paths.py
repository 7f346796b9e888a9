"""The decode fast paths change nothing but speed.

The scheduler's run of one-token decodes (``Scheduler._schedule_decodes``) and the engine's run
of plain decode tokens (``decode_step.apply_decode_tokens``) each serve the common step in one
loop over the batch. Two identical engines run in lock step, one with the fast path and one with
it turned off (every sequence takes the general rule), on the same sampled tokens: every step's
schedule, outputs (in order), finishes, failures, request state, block tables and prefix-cache
registrations must be the same.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from backend.core.block_manager import BlockManager
from backend.core.iteration_stats import TokenHistogram
from backend.core.request import Request
from backend.core.scheduler import Scheduler
from backend.engine import llm_engine as llm_engine_module
from backend.engine.inflight import InFlightStep
from backend.engine.llm_engine import LLMEngine
from backend.messages.runner_output import ModelRunnerOutput
from backend.types.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

EOS = 2
STOP = 3  # a stop token ID of some requests
MAX_MODEL_LEN = 60
BLOCK_SIZE = 4
PARAMS = [
    SamplingParams(max_tokens=None, ignore_eos=True),  # runs to max_model_len
    SamplingParams(max_tokens=7),
    SamplingParams(max_tokens=30, min_tokens=5),
    SamplingParams(max_tokens=25, stop_token_ids=[STOP]),
    SamplingParams(max_tokens=25, stop_token_ids=[STOP], min_tokens=3, ignore_eos=True),
    SamplingParams(max_tokens=20, logprobs=1),
    SamplingParams(max_tokens=1),
]


def make_engine(num_blocks: int, budget: int, max_num_seqs: int = 16) -> LLMEngine:
    """The engine's bookkeeping around a scheduler, without a model (steps go through ``_process``)."""
    engine = LLMEngine.__new__(LLMEngine)
    engine.config = SimpleNamespace(max_model_len=MAX_MODEL_LEN)
    engine.block_manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    engine.scheduler = Scheduler(engine.block_manager, max_num_seqs, budget, MAX_MODEL_LEN)
    engine.structured_output = SimpleNamespace(has_matchers=False)
    engine.beams, engine.children, engine.deadline_of = {}, {}, {}
    engine.eos_token_ids, engine.eos_token_id = (EOS,), EOS
    engine.iteration_tokens = TokenHistogram()
    engine.num_generation_tokens_total = engine.num_prompt_tokens_total = 0
    engine.num_prompt_tokens_computed_total = engine.num_draft_tokens_total = 0
    engine.num_accepted_tokens_total = engine._first_token_prompts = 0
    return engine


def add_requests(engine: LLMEngine, seed: int, count: int) -> None:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 50) for _ in range(2 * BLOCK_SIZE)]  # a prefix some prompts share
    for i in range(count):
        prompt = [rng.randrange(5, 50) for _ in range(rng.randrange(1, 14))]
        if i % 3 == 0:
            prompt = shared + prompt
        sid = f"seq-{i}"
        engine.children[f"r{i}"] = [sid]
        engine.scheduler.add_request(Request(sid, prompt, PARAMS[i % len(PARAMS)], EOS, parent_id=f"r{i}"))


def runner_output(engine: LLMEngine, sched, rng: random.Random, fail: bool) -> ModelRunnerOutput:
    """Tokens for every sampling sequence; EOS and the stop token often. ``fail``: one sequence's
    sampling fails and another's tokens are missing (its bookkeeping raises)."""
    out = ModelRunnerOutput()
    sampling = [s for s in sched.scheduled if s.needs_sample]
    for s in sampling:
        token = rng.choice([EOS, STOP, *range(5, 30)])
        out.sampled_token_ids[s.request_id] = [token]
        if s.sampling_params.logprobs is not None:
            out.logprobs[s.request_id] = [{token: -0.5}]
    if fail and len(sampling) > 3:
        failed, missing = sampling[1].request_id, sampling[-2].request_id
        del out.sampled_token_ids[failed]
        out.failed[failed] = "sampling failed"
        del out.sampled_token_ids[missing]
    return out


def state(engine: LLMEngine) -> tuple:
    bm = engine.block_manager
    return ({rid: (r.status, r.output_token_ids, r.num_computed_tokens, r.num_inflight_tokens,
                   r.num_placeholders, r.stop_reason) for rid, r in engine.scheduler.requests.items()},
            [r.request_id for r in engine.scheduler.running], [r.request_id for r in engine.scheduler.waiting],
            bm.req_blocks, bm.req_num_hashed_blocks, bm.cached_blocks, list(bm.free_blocks),
            engine.num_generation_tokens_total, engine.iteration_tokens.counts, sorted(engine.children))


def turn_off_scheduler_fast_path(engine: LLMEngine) -> None:
    engine.scheduler._schedule_decodes = lambda i, budget, scheduled: (i, budget)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_blocks,budget,later_budget", [(200, 64, 64), (24, 64, 64), (200, 9, 9), (200, 64, 3)])
def test_fast_paths_give_what_the_general_rules_give(monkeypatch, num_blocks, budget, later_budget, async_scheduling):
    """(200, 64): roomy; (24, 64): preemption; (200, 9): a small budget; (200, 64 then 3): more
    sequences decode than the budget has tokens (the decode run is cut short).
    Async: each step is scheduled before the one before is processed (placeholders, preemptions since)."""
    fast, general = make_engine(num_blocks, budget), make_engine(num_blocks, budget)
    turn_off_scheduler_fast_path(general)
    for engine in (fast, general):
        add_requests(engine, seed=num_blocks + budget, count=14)
    rngs = {id(fast): random.Random(7), id(general): random.Random(7)}
    in_flight: dict[int, InFlightStep] = {}
    general_rule_only = lambda scheduled, start, *args: (start, None, None)  # noqa: E731
    for step in range(300):
        if not (fast.scheduler.has_unfinished_requests() or in_flight):
            break
        results = []
        for engine in (fast, general):
            if step == 3:
                engine.scheduler.max_num_batched_tokens = later_budget
            sched = engine.scheduler.schedule()
            launched = InFlightStep(sched, preemptions=engine.scheduler.num_preemptions_total
                                    if async_scheduling else None)
            previous = in_flight.pop(id(engine), None) if async_scheduling else launched
            if async_scheduling and (sched.scheduled or sched.finished_request_ids):
                in_flight[id(engine)] = launched
            outputs = []
            if previous is not None:
                runner_out = runner_output(engine, previous.sched, rngs[id(engine)], fail=step % 9 == 4)
                with monkeypatch.context() as patch:
                    if engine is general:
                        patch.setattr(llm_engine_module, "apply_decode_tokens", general_rule_only)
                    outputs = engine._process(previous, runner_out)
            results.append((sched.scheduled, sched.num_preempted, outputs, state(engine)))
        assert results[0] == results[1], f"step {step}"
    assert not fast.scheduler.has_unfinished_requests() and not general.scheduler.has_unfinished_requests()
    assert fast.block_manager.num_free_blocks == num_blocks
