"""Sampler: greedy, filters, seeds, penalties, min_tokens and logprobs on small CPU vocabularies."""

from __future__ import annotations

import math

import pytest
import torch

import backend.worker.sampler as sampler_module
from backend.worker.logprobs import compute_prompt_logprobs
from backend.worker.sampler import Sampler, SamplingRow, _apply_penalties, _apply_top_p
from sampling_helpers import VOCAB, counts_of, make_row, random_logits


@pytest.fixture(autouse=True)
def fixed_global_rng():
    """Unseeded rows draw from the global RNG; fix it so a failure reproduces."""
    torch.manual_seed(1234)


# --- greedy -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_and_leaves_logits_untouched(dtype):
    logits = random_logits(8).to(dtype)
    before = logits.clone()
    out = Sampler()(logits, [make_row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 8
    assert torch.equal(logits, before)


def test_greedy_rows_mixed_with_random_rows_stay_argmax():
    logits = random_logits(6)
    rows = [make_row(temperature=0.0 if i % 2 == 0 else 1.0, top_p=0.9) for i in range(6)]
    before = logits.clone()
    first = Sampler()(logits, rows).token_ids
    second = Sampler()(logits, rows).token_ids
    argmax = logits.argmax(-1).tolist()
    assert [first[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    assert [second[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    assert torch.equal(logits, before)


def test_top_k_one_at_temperature_one_equals_greedy():
    logits = random_logits(16)
    out = Sampler()(logits, [make_row(temperature=1.0, top_k=1) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_logits_shape_must_match_rows():
    with pytest.raises(ValueError, match="num_rows=2"):
        Sampler()(random_logits(3), [make_row(), make_row()])


# --- seeds ------------------------------------------------------------------


def run_steps(sampler: Sampler, row_index: int, rows: list[SamplingRow], steps: int) -> list[int]:
    """Sample `steps` times from fixed logits; return the tokens of rows[row_index]."""
    tokens = []
    for step in range(steps):
        logits = random_logits(len(rows), seed=100 + step)
        # Give the watched row the same logits whatever its position in the batch.
        logits[row_index] = random_logits(1, seed=500 + step)[0]
        tokens.append(sampler(logits, rows).token_ids[row_index])
    return tokens


@pytest.mark.parametrize("top_p_prefix", [1024, 4])  # 4: the watched row's nucleus needs the full sort
def test_seeded_row_is_independent_of_the_batch(monkeypatch, top_p_prefix):
    monkeypatch.setattr(sampler_module, "_TOP_P_PREFIX", top_p_prefix)
    params = dict(temperature=1.3, top_k=50, top_p=0.95)
    alone = run_steps(Sampler(), 0, [make_row(seed=7, **params)], steps=10)
    batch = [
        make_row(seed=3, temperature=0.7),
        make_row(temperature=1.0),
        make_row(seed=7, **params),
        make_row(temperature=0.0),
        make_row(temperature=1.0, min_p=0.1),
    ]
    in_batch = run_steps(Sampler(), 2, batch, steps=10)
    assert alone == in_batch
    assert len(set(alone)) > 1  # really sampled, not a constant


def test_seeded_row_repeats_with_a_fresh_generator():
    first = run_steps(Sampler(), 0, [make_row(seed=11, temperature=1.0)], steps=10)
    second = run_steps(Sampler(), 0, [make_row(seed=11, temperature=1.0)], steps=10)
    assert first == second


def test_different_seeds_give_different_tokens():
    first = run_steps(Sampler(), 0, [make_row(seed=1, temperature=1.0)], steps=10)
    second = run_steps(Sampler(), 0, [make_row(seed=2, temperature=1.0)], steps=10)
    assert first != second


# --- filters ----------------------------------------------------------------


def test_small_top_p_keeps_only_the_top_token():
    logits = random_logits(1).expand(500, VOCAB).contiguous()
    out = Sampler()(logits, [make_row(temperature=1.0, top_p=1e-3) for _ in range(500)])
    assert set(out.token_ids) == {int(logits[0].argmax())}


def test_top_k_samples_only_from_the_k_largest():
    k = 5
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)) * 0.1  # nearly flat
    expected = set(logits.topk(k).indices.tolist())
    out = Sampler()(logits.expand(2000, VOCAB).contiguous(), [make_row(temperature=1.0, top_k=k) for _ in range(2000)])
    assert set(out.token_ids) == expected  # only the k largest, and each of them


def test_top_p_applies_to_the_distribution_left_by_top_k():
    # probs 0.4, 0.3, 0.2, 0.1: top_k=2 renormalises to 4/7, 3/7, so top_p=0.5 keeps only token 0.
    # Without the top-k renormalisation top_p=0.5 would also keep token 1.
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    batch = logits.expand(1000, 4).contiguous()
    only_top_p = Sampler()(batch, [make_row(temperature=1.0, top_p=0.5) for _ in range(1000)])
    assert set(only_top_p.token_ids) == {0, 1}
    both = Sampler()(batch, [make_row(temperature=1.0, top_k=2, top_p=0.5) for _ in range(1000)])
    assert set(both.token_ids) == {0}


def test_top_p_keeps_the_smallest_prefix_reaching_it():
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()
    out = Sampler()(logits.expand(2000, 4).contiguous(), [make_row(temperature=1.0, top_p=0.8) for _ in range(2000)])
    assert set(out.token_ids) == {0, 1, 2}  # 0.5 + 0.25 < 0.8, + 0.15 reaches it


def reference_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Slow one-row version: walk tokens from most likely, keep while the mass before is below top_p."""
    probs = logits.softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    result = torch.full_like(logits, float("-inf"))
    mass_before = 0.0
    for token in order:
        if mass_before >= top_p:
            break
        result[token] = logits[token]
        mass_before += probs[token]
    return result


@pytest.mark.parametrize("top_p_prefix", [1024, 8])  # 8 < vocab: peaked rows use the prefix, flat ones sort
def test_top_p_matches_the_reference(monkeypatch, top_p_prefix):
    monkeypatch.setattr(sampler_module, "_TOP_P_PREFIX", top_p_prefix)
    vocab = 60
    logits = random_logits(4, vocab=vocab, seed=21)
    logits[0] *= 4  # peaked: nucleus of a few tokens
    logits[2] *= 0.05  # nearly flat: nucleus of most of the vocabulary
    top_ps = [0.9, 0.5, 0.97, 0.3]
    expected = torch.stack([reference_top_p(logits[i], p) for i, p in enumerate(top_ps)])
    actual = logits.clone()
    _apply_top_p(actual, top_ps)
    assert torch.equal(actual.isinf(), expected.isinf())
    assert torch.equal(actual[~actual.isinf()], logits[~actual.isinf()])
    kept = (~actual.isinf()).sum(-1).tolist()
    assert kept[0] < 8 < kept[2]  # both paths really taken when the prefix is 8


def test_min_p_drops_tokens_below_the_fraction_of_the_top():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])  # min_p=0.3 → cut below 0.12
    out = Sampler()(
        probs.log().expand(3000, 5).contiguous(), [make_row(temperature=1.0, min_p=0.3) for _ in range(3000)]
    )
    assert set(out.token_ids) == {0, 1, 2}


def test_sampling_frequencies_follow_softmax():
    logits = torch.tensor([1.0, 0.2, -0.5])
    draws = 4000
    out = Sampler()(logits.expand(draws, 3).contiguous(), [make_row(temperature=1.0) for _ in range(draws)])
    frequencies = counts_of(out.token_ids, 3).float() / draws
    assert torch.allclose(frequencies, logits.softmax(-1), atol=0.05)


def test_temperature_sharpens_the_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0])
    draws = 4000
    out = Sampler()(logits.expand(draws, 3).contiguous(), [make_row(temperature=0.5) for _ in range(draws)])
    frequencies = counts_of(out.token_ids, 3).float() / draws
    assert torch.allclose(frequencies, (logits / 0.5).softmax(-1), atol=0.05)


# --- penalties --------------------------------------------------------------


def reference_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Slow per-token version of the HF/vLLM formulas for one row."""
    result = logits.clone().tolist()
    p = row.params
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    for token in range(len(result)):
        value = result[token]
        if token in seen:
            value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        count = row.output_token_ids.count(token)
        value -= p.frequency_penalty * count
        value -= p.presence_penalty * (1 if count > 0 else 0)
        result[token] = value
    return torch.tensor(result)


def test_penalties_match_the_reference_formula():
    vocab = 50
    rows = [
        make_row(prompt=[1, 2, 2, 3], output=[3, 4, 4, 4, 9], repetition_penalty=1.3),
        make_row(prompt=[5], output=[7, 7, 8], frequency_penalty=0.5, presence_penalty=-0.4),
        make_row(prompt=[10, 11], output=[11, 12, 12], repetition_penalty=0.8, frequency_penalty=-1.0,
                 presence_penalty=1.5),
        make_row(prompt=[10, 11], output=[11, 12]),  # no penalties: untouched
        make_row(prompt=[0], output=[], repetition_penalty=2.0, presence_penalty=1.0),  # nothing generated yet
    ]
    logits = random_logits(len(rows), vocab=vocab, seed=9)
    expected = torch.stack([reference_penalties(logits[i], row) for i, row in enumerate(rows)])
    actual = logits.clone()
    _apply_penalties(actual, rows, [i for i, row in enumerate(rows) if row.has_penalties])
    assert torch.allclose(actual, expected, atol=1e-6)
    assert torch.equal(actual[3], logits[3])


@pytest.mark.parametrize("with_drafts", [True, False])
def test_penalty_history_gives_exactly_the_token_list_penalties_as_outputs_grow(with_drafts):
    """The incremental counts (PenaltyHistory: a list read at first sight, then the sampled tokens
    recorded each step; slots freed and reused, tables grown) give bit for bit what the token lists
    give, drafts before a row included; without drafts through the one-pass kernel."""
    import dataclasses
    import random

    from backend.worker.penalty_history import INITIAL_SLOTS, PenaltyHistory

    vocab, rng = 64, random.Random(3)
    history = PenaltyHistory(vocab, torch.device("cpu"))
    kinds = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=-0.4),
             dict(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=1.5), dict(presence_penalty=2.0)]
    sequences = {f"s{i}": (rng.sample(range(vocab), rng.randint(1, 9)), [], kinds[i % len(kinds)])
                 for i in range(INITIAL_SLOTS + 5)}  # more than the first table holds
    for step in range(12):
        for rid, (_, output, _) in sequences.items():
            sampled = [rng.randrange(vocab) for _ in range(rng.randint(0, 2))]
            output.extend(sampled)
            history.record(rid, sampled)  # ignored before the sequence's first update
        if step == 6:  # some finish, new ones take their slots
            finished = [rid for rid in sequences if int(rid[1:]) % 3 == 0]
            history.release(finished)
            for rid in finished:
                del sequences[rid]
            sequences.update({f"n{i}": ([rng.randrange(vocab)], [rng.randrange(vocab)], kinds[i % 4]) for i in range(4)})
        ids = list(sequences)
        slots = history.update([(rid, sequences[rid][0], sequences[rid][1], len(sequences[rid][1])) for rid in ids])
        drafts = [[rng.randrange(vocab) for _ in range(rng.randint(0, 2) if with_drafts else 0)] for _ in ids]
        rows = [make_row(prompt=sequences[rid][0], output=sequences[rid][1] + extra, **sequences[rid][2])
                for rid, extra in zip(ids, drafts)]
        logits = random_logits(len(rows), vocab=vocab, seed=step)
        expected, actual = logits.clone(), logits.clone()
        _apply_penalties(expected, rows, list(range(len(rows))))
        fast = [dataclasses.replace(row, penalty_slot=slot, extra_history=extra)
                for row, slot, extra in zip(rows, slots, drafts)]
        _apply_penalties(actual, fast, list(range(len(rows))), history)
        assert torch.equal(actual, expected), step
    assert len(set(history.slot_of.values())) == len(sequences)


def test_greedy_with_repetition_penalty_avoids_the_repeated_token():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    plain = Sampler()(logits, [make_row(prompt=[3], output=[0], temperature=0.0)])
    penalized = Sampler()(logits, [make_row(prompt=[3], output=[0], temperature=0.0, repetition_penalty=1.2)])
    assert plain.token_ids == [0]
    assert penalized.token_ids == [1]


# --- min_tokens -------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, 1.0]])  # eos=0, stop ids 1 and 2 rank above the rest
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=[1, 2, 999])  # 999 is outside the vocab
    short = Sampler()(logits, [make_row(output=[4], eos=0, **params)])
    assert short.token_ids == [4]
    reached = Sampler()(logits, [make_row(output=[4, 4], eos=0, **params)])
    assert reached.token_ids == [0]


def test_min_tokens_masks_eos_even_with_ignore_eos():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    out = Sampler()(logits, [make_row(output=[], eos=0, temperature=0.0, min_tokens=1, ignore_eos=True)])
    assert out.token_ids == [1]


def test_min_tokens_masks_random_rows_too():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0]).expand(500, 4).contiguous()
    rows = [make_row(output=[], eos=0, temperature=1.0, min_tokens=3, stop_token_ids=[2]) for _ in range(500)]
    assert set(Sampler()(logits, rows).token_ids) == {1, 3}


# --- logprobs ---------------------------------------------------------------


def check_position(position, logprobs: torch.Tensor, chosen: int, num_top: int) -> None:
    ids = list(position)
    assert ids[0] == chosen
    assert position[chosen].logprob == pytest.approx(logprobs[chosen].item(), abs=1e-6)
    assert position[chosen].rank == 1 + int((logprobs > logprobs[chosen]).sum())
    top = logprobs.topk(num_top)
    for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        assert token in position
        if token != chosen:
            assert position[token].rank == rank
            assert position[token].logprob == pytest.approx(value, abs=1e-6)
    assert set(ids) == {chosen} | set(top.indices.tolist())


def test_logprobs_are_of_the_raw_distribution_with_the_sampled_token_first():
    logits = random_logits(4)  # float32: no ties, so the top-k order is unambiguous
    rows = [
        make_row(temperature=0.7, top_p=0.9, logprobs=3, repetition_penalty=1.5, output=[5, 6]),
        make_row(temperature=0.0, logprobs=5),
        make_row(temperature=1.0),  # no logprobs asked
        make_row(temperature=1.0, top_k=20, logprobs=0, seed=3),
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits.float(), -1)
    check_position(out.logprobs[0], raw[0], out.token_ids[0], 3)
    check_position(out.logprobs[1], raw[1], out.token_ids[1], 5)
    assert out.logprobs[2] is None
    assert list(out.logprobs[3]) == [out.token_ids[3]]
    assert list(out.logprobs[1])[0] == out.token_ids[1] == int(raw[1].argmax())
    assert out.logprobs[1][out.token_ids[1]].rank == 1


def test_logprobs_of_half_precision_logits_are_computed_in_float32():
    logits = random_logits(3).to(torch.bfloat16)
    out = Sampler()(logits, [make_row(temperature=1.0, logprobs=2) for _ in range(3)])
    raw = torch.log_softmax(logits.float(), -1)
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i][token].logprob == pytest.approx(raw[i, token].item(), abs=1e-6)
        assert out.logprobs[i][token].rank == 1 + int((raw[i] > raw[i, token]).sum())


def test_logprob_rank_of_an_unlikely_sampled_token():
    logits = torch.tensor([[1.0, 5.0, 4.0, 3.0]])
    # repetition penalty shrinks tokens 1-3 (5, 4, 3 -> 0.05, ...) below token 0; logprobs stay raw.
    out = Sampler()(logits, [make_row(prompt=[1, 2, 3], temperature=0.0, repetition_penalty=100.0, logprobs=2)])
    assert out.token_ids == [0]
    position = out.logprobs[0]
    assert list(position) == [0, 1, 2]
    assert position[0].rank == 4
    assert [position[1].rank, position[2].rank] == [1, 2]
    raw = torch.log_softmax(logits[0], -1)
    assert position[0].logprob == pytest.approx(raw[0].item(), abs=1e-6)


def test_prompt_logprobs():
    logits = random_logits(6, vocab=40, seed=12)
    targets = [3, 0, 39, 7, 7, 21]
    positions = compute_prompt_logprobs(logits, targets, num_top=4)
    raw = torch.log_softmax(logits.float(), -1)
    assert len(positions) == len(targets)
    for i, target in enumerate(targets):
        check_position(positions[i], raw[i], target, 4)
    only_target = compute_prompt_logprobs(logits, targets, num_top=0)
    assert [list(p) for p in only_target] == [[t] for t in targets]
    assert not math.isnan(only_target[0][3].logprob)


def test_prompt_logprobs_shape_must_match_targets():
    with pytest.raises(ValueError, match="num_positions=2"):
        compute_prompt_logprobs(random_logits(3), [1, 2], num_top=1)


def test_logprob_token_ids_return_those_tokens_with_their_ranks():
    logits = random_logits(2)
    wanted = [7, 150, 3]
    out = Sampler()(logits, [make_row(temperature=0.0, logprob_token_ids=wanted), make_row(temperature=0.0)])
    raw = logits[0].log_softmax(-1)
    position = out.logprobs[0]
    chosen = out.token_ids[0]
    assert list(position)[0] == chosen and set(position) == {chosen, *wanted}
    for token in wanted:
        assert position[token].logprob == pytest.approx(raw[token].item(), abs=1e-5)
        assert position[token].rank == int((raw > raw[token]).sum()) + 1
    assert out.logprobs[1] is None


def test_structured_output_mask_leaves_only_allowed_tokens():
    from backend.messages.grammar_mask import TokenBitmask

    logits = random_logits(2)
    bitmask = torch.zeros(1, -(-VOCAB // 32), dtype=torch.int32)
    bitmask[0, 0] = 0b1010_0000  # tokens 5 and 7
    out = Sampler()(logits, [make_row(temperature=0.0), make_row(temperature=1.0, logprobs=2)],
                    TokenBitmask(bitmask, torch.tensor([1])))
    assert out.token_ids[0] == int(logits[0].argmax())  # row 0 is unconstrained
    assert out.token_ids[1] in (5, 7)
    assert set(out.logprobs[1]) == {5, 7}  # the masked distribution: all its mass on the two
    assert math.isclose(sum(math.exp(lp.logprob) for lp in out.logprobs[1].values()), 1.0, rel_tol=1e-5)


# --- logit_bias -------------------------------------------------------------


def test_logit_bias_forces_forbids_and_shifts_only_its_rows_and_leaves_logprobs_raw():
    logits = random_logits(3)
    top = int(logits[0].argmax())
    rows = [make_row(temperature=0.0, logit_bias={top: -100.0}),  # forbid the winner
            make_row(temperature=0.0, logit_bias={5: 100.0}, logprobs=1),  # force token 5
            make_row(temperature=0.0)]
    out = Sampler()(logits.clone(), rows)
    biased = logits[0].clone()
    biased[top] -= 100.0
    assert out.token_ids[0] == int(biased.argmax()) != top
    assert out.token_ids[1] == 5
    assert out.token_ids[2] == int(logits[2].argmax())
    raw = logits[1].log_softmax(-1)
    assert out.logprobs[1][5].logprob == pytest.approx(float(raw[5]), abs=1e-5)  # before the bias, as vLLM's


def test_logit_bias_applies_to_sampled_rows_too():
    logits = random_logits(64)
    rows = [make_row(temperature=1.0, seed=i, logit_bias={9: 100.0}) for i in range(64)]
    assert Sampler()(logits, rows).token_ids == [9] * 64
