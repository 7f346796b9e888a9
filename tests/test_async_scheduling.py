"""Async scheduling (step N+1 scheduled and launched before step N's tokens are processed) is exact.

Every sequence's tokens, finish reasons and logprobs are the same with it on and off, in a batch
mixing every request feature, with preemption and chunked prefill forced; a sequence that stops
(stop token, EOS, max_tokens, grammar end, abort) never returns a token past its end; aborts while
a step is in flight free every block. The batch-mix fuzzer runs a configuration with it too.
"""

from __future__ import annotations

import threading

import pytest

from backend.engine.llm_engine import LLMEngine
from backend.messages.scheduler_output import PLACEHOLDER_TOKEN_ID
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.outputs import FinishReason
from backend.types.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 50)), [7] * 9, [30, 31, 32, 33]]
EOS = 2


def make_engine(checkpoint, async_scheduling: bool, defer: bool = False, **kwargs) -> LLMEngine:
    """defer: greedy decode steps are left pending on the device until the next is queued (the
    CUDA default, backend/executor/uni.py), here on the CPU, to check its bookkeeping."""
    arguments = dict(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=26,
                     max_model_len=96, max_num_seqs=6, max_num_batched_tokens=24, seed=0,
                     async_scheduling=async_scheduling)
    arguments.update(kwargs)
    engine = LLMEngine(EngineConfig(**arguments))
    engine.executor.defer_steps = defer
    return engine


def mixed_requests(stop_id: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Every request feature whose tokens are deterministic (seeded when random); ``stop_id``:
    a token the greedy "stop-token" sequence produces a few tokens in."""
    greedy = dict(temperature=0.0)
    specs = [
        ("plain", PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True, **greedy)),
        ("eos", PROMPTS[1], SamplingParams(max_tokens=40, **greedy)),
        ("stop-token", PROMPTS[2], SamplingParams(max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True,
                                                  **greedy)),
        ("penalties", PROMPTS[3], SamplingParams(max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.4,
                                                 presence_penalty=0.3, ignore_eos=True, **greedy)),
        ("min-tokens", PROMPTS[4], SamplingParams(max_tokens=12, min_tokens=8, stop_token_ids=[9], **greedy)),
        ("seeded", PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=20, seed=7,
                                              ignore_eos=True)),
        ("n2", PROMPTS[1], SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)),
        ("logprobs", PROMPTS[2], SamplingParams(max_tokens=8, logprobs=3, prompt_logprobs=2, **greedy)),
        ("regex", PROMPTS[3], SamplingParams(max_tokens=30, structured_outputs={"regex": r"[0-9]{2}-[a-z]{2}"},
                                             **greedy)),
        ("choice", PROMPTS[4], SamplingParams(max_tokens=30, structured_outputs={"choice": ["Paris", "Lyon"]},
                                              **greedy)),
        ("beam", PROMPTS[0], SamplingParams(n=2, use_beam_search=True, max_tokens=6, ignore_eos=True)),
        ("one-token", PROMPTS[4], SamplingParams(max_tokens=1, **greedy)),
        ("logit-bias", PROMPTS[1], SamplingParams(max_tokens=10, logit_bias={stop_id: -100.0, 5: 3.0},
                                                  ignore_eos=True, **greedy)),
    ]
    return specs


def run(engine: LLMEngine, specs, abort_after: dict[str, int] | None = None, max_steps: int = 3000) -> dict:
    """Add every request, step until idle: client ID -> {index: (tokens, finish reason, logprobs)}."""
    for request_id, prompt, params in specs:
        engine.add_request(request_id, prompt, params)
    results: dict = {}
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for request_id, at in (abort_after or {}).items():
            if step == at:
                engine.abort_request([request_id])
        for out in engine.step():
            tokens, reason, logprobs = results.setdefault(out.request_id, {}).setdefault(out.index, ([], [None], []))
            assert reason[0] is None, f"{out.request_id}[{out.index}] got output after it finished"
            tokens += out.new_token_ids
            logprobs += out.new_logprobs or []
            reason[0] = out.finish_reason
    assert not engine.has_unfinished_requests(), "the engine did not drain"
    return {rid: {i: (tokens, reason[0], logprobs) for i, (tokens, reason, logprobs) in seqs.items()}
            for rid, seqs in results.items()}


def assert_idle(engine: LLMEngine) -> None:
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.children and not engine.beams and not engine.structured_output.has_matchers
    assert engine._inflight is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import json

    from conftest import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-async"), "llama", seed=1)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = EOS  # a random model samples it now and then: EOS stops matter
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("defer", [False, True], ids=["read-each-step", "deferred"])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_outputs_are_identical_with_async_scheduling_on_and_off(checkpoint, enforce_eager, defer):
    engine = make_engine(checkpoint, False, enforce_eager=enforce_eager)
    try:
        probe = run(engine, [("p", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))])
    finally:
        engine.shutdown()
    specs = mixed_requests(stop_id=probe["p"][0][0][4])
    outcomes = {}
    for async_scheduling in (False, True):
        engine = make_engine(checkpoint, async_scheduling, defer=defer, enforce_eager=enforce_eager)
        try:
            assert engine.async_scheduling is async_scheduling
            outcomes[async_scheduling] = run(engine, specs)
            assert engine.scheduler.num_preemptions_total > 0, "the cache is meant to force preemptions"
            assert_idle(engine)
        finally:
            engine.shutdown()
    sync, pipelined = outcomes[False], outcomes[True]
    assert sync.keys() == pipelined.keys() == {rid for rid, _, _ in specs}
    for request_id in sync:
        assert pipelined[request_id] == sync[request_id], request_id
    # The stops the batch is meant to exercise did happen (else the comparison proves less).
    assert sync["stop-token"][0][1] == FinishReason.STOP and len(sync["stop-token"][0][0]) <= 5
    assert sync["one-token"][0][1] == FinishReason.LENGTH and len(sync["one-token"][0][0]) == 1
    assert all(len(tokens) <= 12 for tokens, _, _ in sync["min-tokens"].values())


def test_steps_overlap_and_placeholders_carry_the_tokens_in_flight(checkpoint):
    """The next step is launched before the last is processed (on a thread of its own), and its
    placeholder inputs get the tokens the step before sampled."""
    engine = make_engine(checkpoint, True)
    runner = engine.executor.worker.runner
    seen = {"placeholders": 0, "threads": set()}
    prepare = runner._prepare_inputs

    def spying_prepare(scheduled):
        seen["placeholders"] += sum(s.token_ids[-1] == PLACEHOLDER_TOKEN_ID for s in scheduled)
        seen["threads"].add(threading.get_ident())
        inputs = prepare(scheduled)
        assert int(inputs.input_ids.min()) >= 0, "a placeholder reached the model"
        return inputs

    runner._prepare_inputs = spying_prepare
    try:
        engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        assert engine.step() == []  # the first call only launches
        assert engine._inflight is not None and engine.has_unfinished_requests()
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
        assert len(tokens) == 10
        assert seen["placeholders"] >= 8
        assert seen["threads"] and threading.get_ident() not in seen["threads"]
        assert_idle(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("defer", [False, True], ids=["read-each-step", "deferred"])
def test_aborts_while_a_step_is_in_flight_free_everything_and_stop_the_outputs(checkpoint, defer):
    engine = make_engine(checkpoint, True, defer=defer)
    try:
        specs = [(f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
                 for i in range(6)]
        # Aborted at different points: before the first launch is processed, mid-prefill, mid-decode.
        results = run(engine, specs, abort_after={"r0": 1, "r1": 2, "r2": 5, "r3": 9})
        for request_id in ("r0", "r1", "r2", "r3"):
            for tokens, reason, _ in results.get(request_id, {}).values():
                assert reason is None and len(tokens) < 40
        for request_id in ("r4", "r5"):
            assert results[request_id][0][1] == FinishReason.LENGTH and len(results[request_id][0][0]) == 40
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_deferred_steps_are_read_after_the_next_is_launched_and_leave_nothing_behind(checkpoint):
    """Plain decode steps (greedy or drawn) are left pending until the next step is queued: each is read after
    the following launch (or when the engine asks for it, when none follows); other steps read the
    pending one first. The outputs equal the synchronous engine's; no sequence's last token outlives it."""
    specs = [(f"g{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0.0, max_tokens=12 + i, ignore_eos=True))
             for i in range(4)]
    specs.append(("sampled", PROMPTS[1], SamplingParams(temperature=0.8, seed=5, max_tokens=9, ignore_eos=True)))
    engine = make_engine(checkpoint, False)
    try:
        expected = run(engine, specs)
    finally:
        engine.shutdown()
    engine = make_engine(checkpoint, True, defer=True)
    runner = engine.executor.worker.runner
    events: list[str] = []
    launch, read = runner.launch, runner.read

    drawn = []  # deferred steps with a temperature-sampled sequence

    threads = {"launch-deferred": set(), "run": set(), "read": set()}

    def spying_launch(sched, defer, greedy=False):
        events.append("launch-deferred" if defer else "run")
        threads[events[-1]].add(threading.get_ident())
        if defer and any(not s.sampling_params.greedy for s in sched.scheduled):
            drawn.append(len(events))
        if defer:  # greedy: every token an argmax (deferral's finding), checked here
            assert greedy == all(s.sampling_params.greedy for s in sched.scheduled)
        return launch(sched, defer, greedy)

    def spying_read(step):
        events.append("read")
        threads["read"].add(threading.get_ident())
        return read(step)

    runner.launch, runner.read = spying_launch, spying_read
    try:
        assert run(engine, specs) == expected
        assert_idle(engine)
        assert runner.pending is None
        # The runner hears of the last sequences' end with the next step: then they are gone.
        before = set(runner.last_sampled)
        run(engine, [("after", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3))])
        assert not before & set(runner.last_sampled) and len(runner.last_sampled) <= 1
    finally:
        engine.shutdown()
    assert events.count("launch-deferred") >= 5 and events.count("read") == events.count("launch-deferred")
    assert drawn, "temperature sampling (seeded, no top-p) is deferred too"
    # A deferred step is launched and read on the engine's thread (no hand-over per step); the
    # others run on the step thread, so the engine processes the step before meanwhile.
    assert threads["launch-deferred"] == threads["read"] == {threading.get_ident()}
    assert threads["run"] and threading.get_ident() not in threads["run"]
    for i, event in enumerate(events):
        if event == "launch-deferred":  # its read comes after the next launch, if any launch follows
            later = events[i + 1:]
            if "read" in later and any(e != "read" for e in later):
                assert later[0] != "read" or "launch-deferred" not in later[:later.index("read")], events


def test_penalized_biased_and_min_tokens_steps_are_deferred_and_exact(checkpoint):
    """Penalties, logit_bias and min_tokens need nothing on the host between steps: their steps
    are deferred (the penalized tokens counted on the device before the next step reads them),
    and the outputs equal the synchronous engine's, greedy and seeded."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    penalties = dict(repetition_penalty=1.5, frequency_penalty=1.5, presence_penalty=0.5)
    specs = [("pen", PROMPTS[3], SamplingParams(max_tokens=24, **penalties, **greedy)),
             ("pen-drawn", PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True,
                                                      frequency_penalty=1.0)),
             ("bias", PROMPTS[1], SamplingParams(max_tokens=14, logit_bias={5: 4.0, 6: -100.0}, **greedy)),
             ("min", PROMPTS[4], SamplingParams(max_tokens=12, min_tokens=10, temperature=0.0))]
    engine = make_engine(checkpoint, False)
    try:
        expected = run(engine, specs)
        unpenalized = run(engine, [("pen", PROMPTS[3], SamplingParams(max_tokens=24, **greedy))])
    finally:
        engine.shutdown()
    assert unpenalized["pen"][0][0] != expected["pen"][0][0], "the penalties must change the tokens"
    engine = make_engine(checkpoint, True, defer=True)
    runner = engine.executor.worker.runner
    launch = runner.launch
    deferred: set[str] = set()

    def spying_launch(sched, defer, greedy=False):
        for s in sched.scheduled if defer else ():  # internal IDs differ: tell them by their parameters
            params = s.sampling_params
            deferred.update({"pen" if params.greedy else "pen-drawn"} if params.has_penalties else set())
            deferred.update({"bias"} if params.logit_bias else set())
            deferred.update({"min"} if s.num_output_tokens < params.min_tokens else set())
        return launch(sched, defer, greedy)

    runner.launch = spying_launch
    try:
        assert run(engine, specs) == expected
        assert_idle(engine)
    finally:
        engine.shutdown()
    assert {"pen", "pen-drawn", "bias", "min"} <= deferred, deferred


def test_a_stop_at_step_n_drops_the_token_step_n_plus_1_computed(checkpoint):
    """The sequence stops on its stop token; the pipeline had already launched its next token,
    which is computed and dropped: the output ends at the stop token."""
    engine = make_engine(checkpoint, False)
    try:
        free = run(engine, [("probe", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))])
    finally:
        engine.shutdown()
    probe = free["probe"][0][0]
    stop = probe[5]
    first = probe.index(stop)
    engine = make_engine(checkpoint, True)
    try:
        stopped = run(engine, [("s", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                                 stop_token_ids=[stop]))])
        tokens, reason, _ = stopped["s"][0]
        assert tokens == probe[:first + 1] and reason == FinishReason.STOP
        assert engine.num_generation_tokens_total == first + 1  # the dropped token is not counted
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_async_scheduling_refuses_what_it_cannot_do():
    with pytest.raises(InvalidRequestError, match="speculative"):
        EngineConfig(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(InvalidRequestError, match="single worker"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(InvalidRequestError, match="single worker"):
        EngineConfig(async_scheduling=True, distributed_executor_backend="mp")
    # The default: off on the CPU, on with CUDA and one worker.
    config = EngineConfig()
    config.device_type = "cpu"
    assert not config.use_async_scheduling
    config.device_type = "cuda"
    assert config.use_async_scheduling
