"""A decode step's sampling rows are kept for the next step while it samples the same sequences
(backend/worker/sampling_rows.py), and the tokens stay exactly those of rows built afresh.

Unit: a request ID reused after its finish (another request, other penalties, the freed history
slot) gets its own parameters; min_tokens still moves with the output count; the tokens recorded
between steps are counted. Engine: the outputs with kept rows equal those with rows rebuilt every
step, with requests joining and finishing mid-run (history slots reused by requests with other
penalties), aborts, async scheduling on and off, deferred steps.
"""

from __future__ import annotations

import pytest
import torch

from backend.messages.scheduler_output import ScheduledRequest
from backend.types.sampling_params import SamplingParams
from backend.worker.sampler import Sampler, _apply_penalties
from backend.worker.sampling_rows import SamplingRows
from test_async_scheduling import PROMPTS, checkpoint, make_engine, run  # noqa: F401 (checkpoint: a fixture)

VOCAB = 32
EOS = 1


def scheduled(request_id: str, prompt: list[int], output: list[int], **params) -> ScheduledRequest:
    return ScheduledRequest(request_id, [output[-1] if output else prompt[-1]], len(prompt) + len(output) - 1,
                            [0], True, SamplingParams(temperature=0.0, **params), prompt, output, EOS)


def sample_rows(requests: list[ScheduledRequest]) -> list[tuple[ScheduledRequest, int, int]]:
    return [(s, i, 0) for i, s in enumerate(requests)]


def penalized(logits: torch.Tensor, sampling: SamplingRows, requests: list[ScheduledRequest]):
    """(the batch, ``logits`` penalized through its kept rows and uploads)."""
    batch = sampling.batch(sample_rows(requests), VOCAB)
    out = logits.clone()
    _apply_penalties(out, batch.rows, batch.classes.penalties, sampling.history, None, batch.classes.uploads)
    return batch, out


def reference(logits: torch.Tensor, requests: list[ScheduledRequest]) -> torch.Tensor:
    """``logits`` penalized from the token lists (no history, nothing kept)."""
    rows = SamplingRows(torch.device("cpu")).batch(sample_rows(requests), VOCAB).rows
    out = logits.clone()
    _apply_penalties(out, rows, [i for i, row in enumerate(rows) if row.has_penalties])
    return out


def test_a_request_id_reused_after_its_finish_gets_its_own_penalties_and_a_clean_slot():
    sampling = SamplingRows(torch.device("cpu"))
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    first = [scheduled("a", [3, 4, 5], [6, 6], repetition_penalty=2.0), scheduled("b", [7], [8], frequency_penalty=1.0)]
    batch, out = penalized(logits, sampling, first)
    assert torch.equal(out, reference(logits, first))
    again, _ = penalized(logits, sampling, first)
    assert again is batch, "the same sequences in the same order reuse the kept rows"
    sampling.release(["a"])  # "a" finished: its slot is free, its ID may name another request
    second = [scheduled("a", [9, 10], [11], presence_penalty=2.0, frequency_penalty=-0.5), first[1]]
    batch2, out2 = penalized(logits, sampling, second)
    assert batch2 is not batch
    assert batch2.rows[0].params is second[0].sampling_params
    assert torch.equal(out2, reference(logits, second))
    assert not torch.equal(out2, out), "the new request's penalties differ from the old one's"


def test_kept_rows_count_the_tokens_recorded_since_and_follow_min_tokens():
    sampling, sampler = SamplingRows(torch.device("cpu")), Sampler()
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 5.0  # EOS wins unless masked
    logits[:, 20] = 4.0
    logits[:, 21] = 3.0
    outputs = [[], []]
    requests = lambda: [scheduled("m", [3], outputs[0], min_tokens=2),  # noqa: E731
                        scheduled("p", [3], outputs[1], min_tokens=3, frequency_penalty=2.0)]
    picked, batches = [], set()
    for step in range(4):
        batch = sampling.batch(sample_rows(requests()), VOCAB)
        batches.add(id(batch))
        tokens = sampler(logits, batch.rows, None, sampling.history, batch.classes).token_ids
        for output, token in zip(outputs, tokens):
            output.append(token)
        sampling.history.record_all({"p": [tokens[1]]})
        picked.append(tokens)
    # "m": EOS masked for 2 tokens; "p": 20 then 21 (20 penalized by 2 after one use), EOS from its 4th.
    assert picked == [[20, 20], [20, 21], [EOS, 20], [EOS, EOS]]
    assert len(batches) == 1, "one batch kept across the steps"


def test_a_batch_with_drafts_is_not_kept():
    sampling = SamplingRows(torch.device("cpu"))
    s = ScheduledRequest("d", [4, 5, 6], 3, [0], True, SamplingParams(temperature=0.0, repetition_penalty=1.5),
                         [1, 2, 3], [4], EOS, num_draft_tokens=2)
    rows = [(s, 0, 0), (s, 1, 1), (s, 2, 2)]
    first = sampling.batch(rows, VOCAB)
    assert not first.one_row_each
    assert sampling.batch(rows, VOCAB) is not first
    assert [list(row.extra_history) for row in first.rows] == [[], [5], [5, 6]]


def penalized_specs() -> list[tuple[str, list[int], SamplingParams]]:
    """More sequences than the engine runs at once, each with other penalties (or none), finishing
    at different steps: later ones join as earlier ones finish and take their history slots."""
    kinds = [dict(repetition_penalty=1.6), dict(frequency_penalty=1.2, presence_penalty=0.4), {},
             dict(presence_penalty=2.0, min_tokens=5), dict(repetition_penalty=0.7, frequency_penalty=-0.5),
             dict(temperature=0.9, seed=5, frequency_penalty=0.8)]
    specs = []
    for i in range(14):
        extra = dict(kinds[i % len(kinds)])
        extra.setdefault("temperature", 0.0)
        specs.append((f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=6 + (5 * i) % 17,
                                                                          ignore_eos=i % 4 != 0, **extra)))
    return specs


@pytest.mark.parametrize("async_scheduling,defer", [(False, False), (True, False), (True, True)],
                         ids=["sync", "async", "async-deferred"])
def test_outputs_with_kept_rows_equal_rows_rebuilt_every_step(checkpoint, monkeypatch, async_scheduling, defer):  # noqa: F811
    specs, aborts = penalized_specs(), {"r3": 9, "r8": 14}

    def outputs():  # a fresh engine each time: the same steps (no prefix cached by the run before)
        engine = make_engine(checkpoint, async_scheduling, defer=defer, max_num_seqs=4)
        try:
            return run(engine, specs, abort_after=aborts)
        finally:
            engine.shutdown()

    kept = outputs()
    hits = []
    batch = SamplingRows.batch

    def rebuilt(self, rows, vocab_size):  # the reference: nothing kept from the step before
        hits.append(self._last is not None and [s.request_id for s, _, _ in rows] == self._last.request_ids)
        self.forget_batch()
        return batch(self, rows, vocab_size)

    monkeypatch.setattr(SamplingRows, "batch", rebuilt)
    assert outputs() == kept
    assert sum(hits) > len(hits) // 2, "most steps would have reused the kept rows"
    assert any(tokens for seqs in kept.values() for tokens, _, _ in seqs.values())


def test_outputs_with_on_device_counts_equal_penalties_from_the_token_lists(checkpoint, monkeypatch):  # noqa: F811
    """Synchronous steps count their penalized tokens on the device as they sample them (the fused
    greedy kernel, or one count after a random row): the outputs equal those of penalties computed
    from each request's token lists every step (no history slots). Small frequency penalties, so
    that a token counted twice (as a doubled penalty) or not at all changes the outputs."""
    def specs(frequency: float) -> list[tuple[str, list[int], SamplingParams]]:
        kinds = [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.2),
                 dict(temperature=0.0, presence_penalty=0.3), dict(temperature=0.8, seed=4)]
        return [(f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=12 + i, ignore_eos=True,
                                                                     frequency_penalty=frequency, **kinds[i % 4]))
                for i in range(8)]

    def outputs(frequency: float):
        engine = make_engine(checkpoint, False, max_num_seqs=4)
        try:
            return run(engine, specs(frequency), abort_after={"r2": 7})
        finally:
            engine.shutdown()

    counted = outputs(0.1)
    assert outputs(0.2) != counted, "counting a token twice would change the outputs"
    monkeypatch.setattr(SamplingRows, "penalty_slots", lambda self, requests, vocab_size: {})
    assert outputs(0.1) == counted
