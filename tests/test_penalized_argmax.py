"""The greedy step with penalties in one kernel (``penalized_argmax``: penalize a scratch row, pick,
count the token) against its reference, and the sampler's on-device counting against penalties
computed from the token lists."""

from __future__ import annotations

import pytest
import torch

import tandem_kernels.cpu as cpu
from backend.worker.sampler import Sampler
from sampling_helpers import VOCAB, counts_of, make_row, random_logits
from tandem_kernels import reference

needs_kernels = pytest.mark.skipif(not cpu.available(), reason="the fused CPU kernels are not built here")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalized_argmax_matches_penalties_then_argmax_and_counts_the_tokens(dtype):
    """One kernel instead of copy, apply_penalties, argmax_rows and index_put_: the same tokens
    (ties, NaN, unpenalized rows, bf16 logits), the same counts, and the logits left as they were."""
    gen = torch.Generator().manual_seed(5)
    vocab, slots = 1000 + 3, 7
    prompt_seen = torch.rand(slots, vocab, generator=gen) < 0.1
    output_counts = torch.randint(0, 4, (slots, vocab), generator=gen, dtype=torch.int32)
    output_counts[output_counts < 3] = 0
    logits = (torch.randn(8, vocab, generator=gen) * 5).to(dtype)
    logits[1, [3, 700]] = 50.0  # a tie in a penalized row, both tokens unseen: the first one wins
    prompt_seen[6, [3, 700]] = False
    output_counts[6, [3, 700]] = 0
    logits[4, [9, 600]] = float("nan")  # a NaN counts as the maximum, penalized or not
    logits[7, 0] = float("nan")
    output_counts[4, logits[2].float().argmax()] = 3  # row 2's best token, penalized away below
    rows = torch.tensor([6, 1, 4, 0, 2])  # rows 3, 5 and 7 not penalized
    table = torch.tensor([2, 6, 0, 5, 4])
    repetition = torch.tensor([1.3, 1.1, 0.8, 2.0, 1.0])
    frequency = torch.tensor([0.0, 0.5, -1.0, 0.25, 30.0])
    presence = torch.tensor([0.0, -0.4, 1.5, 0.0, 2.0])
    args = (rows, prompt_seen, output_counts, table, repetition, frequency, presence)
    before = logits.clone()
    for count in (False, True):
        expected_counts, actual_counts = output_counts.clone(), output_counts.clone()
        expected = reference.penalized_argmax(logits, rows, prompt_seen, expected_counts, *args[3:], count)
        actual = cpu.penalized_argmax(logits, rows, prompt_seen, actual_counts, *args[3:], count)
        assert torch.equal(actual, expected), count
        assert torch.equal(actual_counts, expected_counts), count
        torch.testing.assert_close(logits, before, rtol=0, atol=0, equal_nan=True)
    work = logits.to(torch.float32, copy=True)
    reference.apply_penalties(work, *args)
    assert torch.equal(actual, reference.argmax_rows(work))
    assert torch.equal(actual[[3, 5, 7]], reference.argmax_rows(logits[[3, 5, 7]]))
    assert actual[1] == 3 and actual[4] == 9 and actual[7] == 0
    assert actual[2] != reference.argmax_rows(logits)[2]
    assert int((actual_counts - output_counts).sum()) == len(rows)
    assert torch.equal((actual_counts - output_counts)[table, actual[rows]], torch.ones(len(rows), dtype=torch.int32))
    with pytest.raises(RuntimeError, match="listed twice"):
        cpu.penalized_argmax(logits, torch.tensor([6, 1, 4, 0, 6]), prompt_seen, output_counts, *args[3:], True)
    with pytest.raises(RuntimeError, match="slot is out of range"):
        cpu.penalized_argmax(logits, rows, prompt_seen, output_counts, torch.tensor([0, 0, 0, 0, slots]),
                             *args[4:], True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_random_row", [False, True])
def test_penalized_steps_counted_on_the_device_match_the_token_lists(dtype, with_random_row):
    """Steps sampled with ``count=True`` (greedy with penalties: the one fused kernel; with a random
    row: penalties, sampling, then one count) give the tokens the token lists give, the logits
    untouched, and leave each penalized sequence's outputs counted exactly once."""
    import dataclasses
    import random

    from backend.worker.penalty_history import PenaltyHistory
    from backend.worker.sampler import classify

    vocab, rng = 48, random.Random(7)
    history = PenaltyHistory(vocab, torch.device("cpu"))
    kinds = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7, presence_penalty=-0.4),
             dict(repetition_penalty=0.8, frequency_penalty=1.0, presence_penalty=1.5), dict()]
    sequences = [(f"s{i}", rng.sample(range(vocab), 5), [rng.randrange(vocab)], kinds[i % 4]) for i in range(6)]
    slots = history.update([(rid, prompt, output, len(output)) for rid, prompt, output, kind in sequences
                            if kind])
    slot_of = dict(zip([rid for rid, _, _, kind in sequences if kind], slots))
    extra = dict(temperature=0.9, seed=3) if with_random_row else dict(temperature=0.0)
    moved = 0
    for step in range(8):
        rows = [make_row(prompt=prompt, output=list(output), **kind, **(extra if i == 0 else dict(temperature=0.0)))
                for i, (_, prompt, output, kind) in enumerate(sequences)]
        fast = [dataclasses.replace(row, penalty_slot=slot_of.get(rid), generator=None if row.generator is None
                                    else torch.Generator().manual_seed(100 + step))
                for row, (rid, _, _, _) in zip(rows, sequences)]
        if with_random_row:  # the same draw on both sides
            rows[0].generator = torch.Generator().manual_seed(100 + step)
        logits = (random_logits(len(rows), vocab=vocab, seed=step) * 2).to(dtype)
        before = logits.clone()
        expected = Sampler()(logits, rows).token_ids
        actual = Sampler()(logits, fast, None, history, classify(fast), count=True).token_ids
        assert actual == expected, step
        assert torch.equal(logits, before)
        moved += expected != Sampler()(logits, [make_row(temperature=0.0) for _ in rows]).token_ids
        for (rid, _, output, kind), token in zip(sequences, actual):
            output.append(token)
            if kind:
                assert torch.equal(history.output_counts[slot_of[rid]], counts_of(output, vocab).int()), (step, rid)
    assert moved  # the penalties changed some step's tokens


def test_count_is_refused_with_logprob_rows():
    from backend.worker.penalty_history import PenaltyHistory

    history = PenaltyHistory(VOCAB, torch.device("cpu"))
    slot, = history.update([("a", [1], [], 0)])
    row = make_row(temperature=0.0, repetition_penalty=1.2, logprobs=1)
    row.penalty_slot = slot
    with pytest.raises(ValueError, match="logprob"):
        Sampler()(random_logits(1), [row], None, history, count=True)
    assert not history.output_counts.any()
