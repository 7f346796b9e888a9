"""A step of single decode tokens takes the array path of ``build_step_inputs``; it must build
exactly what the general, sequence-by-sequence path builds for the same step."""

from __future__ import annotations

import random

import pytest
import torch

from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest
from backend.types.sampling_params import SamplingParams
from backend.worker import step_inputs
from backend.worker.block_tables import BlockTables
from backend.worker.deferred_step import DeferredStep
from backend.worker.staged_upload import StagedUpload

pytestmark = pytest.mark.timeout(60)

BLOCK_SIZE = 4


def decode_batch(rng: random.Random, size: int, placeholders: bool) -> list[ScheduledRequest]:
    params = SamplingParams(temperature=0.0)
    batch = []
    for i in range(size):
        position = rng.randrange(0, 60)
        blocks = rng.sample(range(1000), position // BLOCK_SIZE + 1 + rng.randrange(2))  # a spare block at times
        token = PLACEHOLDER_TOKEN_ID if placeholders and rng.random() < 0.7 else rng.randrange(500)
        batch.append(ScheduledRequest(f"seq-{i}", [token], position, blocks, True, params, [1] * 3, [2],
                                      None))
    rng.shuffle(batch)
    return batch


def tensors(inputs: step_inputs.StepInputs) -> dict[str, object]:
    meta, plan = inputs.meta, inputs.meta.plan
    return {"input_ids": inputs.input_ids.tolist(), "positions": inputs.positions.tolist(),
            "slots": meta.slot_mapping.tolist(), "tables": meta.block_tables.tolist(),
            "seq_lens": meta.seq_lens.tolist(), "query_start": meta.query_start_loc.tolist(),
            "max_query_len": meta.max_query_len, "max_seq_len": meta.max_seq_len,
            "logits_rows": inputs.logits_rows, "logits_index": inputs.logits_index.tolist(),
            "sample_rows": [(s.request_id, i, j) for s, i, j in inputs.sample_rows],
            "prompt_rows": inputs.prompt_rows, "plan": type(plan).__name__,
            "dtypes": [t.dtype for t in (inputs.input_ids, inputs.positions, meta.slot_mapping,
                                         meta.block_tables, meta.seq_lens, meta.query_start_loc)]}


@pytest.mark.parametrize("stage", [False, True], ids=["cpu", "staged"])
@pytest.mark.parametrize("placeholders", [False, True], ids=["tokens", "placeholders"])
def test_a_decode_step_builds_what_the_general_path_builds(stage, placeholders):
    rng = random.Random(7)
    upload = StagedUpload(torch.device("cpu"), stage=stage)
    tables = {name: BlockTables() for name in ("decode", "mixed")}
    for size in (1, 3, 17, 64):
        batch = decode_batch(rng, size, placeholders)
        # With async scheduling: some placeholders wait on the deferred step's tokens (on the
        # device), the others were read already, one belongs to a sequence that failed (none).
        pending = DeferredStep(ModelRunnerOutput(), [s.request_id for s in batch], torch.arange(1000, 1000 + size))
        for row, s in enumerate(batch):
            if row % 3:
                pending.forget(s.request_id)
        last_sampled = {s.request_id: 10 + i for i, s in enumerate(batch) if i % 5}
        built = {name: build(batch, BLOCK_SIZE, tables[name], last_sampled, upload, pending)
                 for name, build in (("decode", step_inputs._decode_step_inputs),
                                     ("mixed", step_inputs._mixed_step_inputs))}
        assert tensors(built["decode"]) == tensors(built["mixed"]), size
        if placeholders:
            filled = built["decode"].input_ids.tolist()
            assert any(t >= 1000 for t in filled) and PLACEHOLDER_TOKEN_ID not in filled


@pytest.mark.parametrize("change", ["none", "forgotten", "reordered", "one known", "one more"])
def test_a_decode_step_behind_a_deferred_one_takes_its_tokens_row_for_row(change):
    """Async scheduling's usual step runs the sequences of the deferred step before it, in its
    order, each on a placeholder: the tokens are copied over whole. Any difference (a sequence
    forgotten, another order, a token known already, a sequence more) takes the row-by-row path;
    every variant builds what the general path builds."""
    rng = random.Random(3)
    batch = decode_batch(rng, 12, placeholders=False)
    batch = [ScheduledRequest(s.request_id, [PLACEHOLDER_TOKEN_ID], *astuple_tail(s)) for s in batch]
    order = [s.request_id for s in batch]
    last_sampled = {request_id: 10 + i for i, request_id in enumerate(order)}
    if change == "reordered":
        order = order[1:] + order[:1]
    elif change == "one known":
        batch[4] = ScheduledRequest(batch[4].request_id, [77], *astuple_tail(batch[4]))
    elif change == "one more":
        order = order[:-1]
    pending = DeferredStep(ModelRunnerOutput(), order, torch.arange(1000, 1000 + len(order)))
    if change == "forgotten":
        pending.forget(order[5])
    upload = StagedUpload(torch.device("cpu"), stage=False)
    built = {name: build(batch, BLOCK_SIZE, BlockTables(), last_sampled, upload, pending)
             for name, build in (("decode", step_inputs._decode_step_inputs),
                                 ("mixed", step_inputs._mixed_step_inputs))}
    assert tensors(built["decode"]) == tensors(built["mixed"])
    expected = {"none": list(range(1000, 1012)), "forgotten": [*range(1000, 1005), 15, *range(1006, 1012)],
                "reordered": [1011, *range(1000, 1011)], "one known": [*range(1000, 1004), 77, *range(1005, 1012)],
                "one more": [*range(1000, 1011), 21]}[change]
    assert built["decode"].input_ids.tolist() == expected


def astuple_tail(s: ScheduledRequest) -> tuple:
    """A scheduled request's fields after its token IDs."""
    return (s.start_pos, s.block_ids, s.needs_sample, s.sampling_params, s.prompt_token_ids, s.output_token_ids,
            s.eos_token_id)


def test_the_array_path_serves_only_steps_of_single_decode_tokens(monkeypatch):
    calls = []
    monkeypatch.setattr(step_inputs, "_decode_step_inputs", lambda *a: calls.append("decode"))
    monkeypatch.setattr(step_inputs, "_mixed_step_inputs", lambda *a: calls.append("mixed"))
    rng = random.Random(0)
    batch = decode_batch(rng, 4, placeholders=False)
    chunk = ScheduledRequest("prefill", [5, 6, 7], 0, [1], True, SamplingParams(), [5, 6, 7], [], None)
    no_sample = ScheduledRequest("chunk", [5], 8, [1, 2, 3], False, SamplingParams(), [5] * 20, [], None)
    wants_prompt_logprobs = ScheduledRequest("plp", [5], 0, [4], True, SamplingParams(prompt_logprobs=1),
                                             [5], [], None)
    for scheduled in (batch, batch + [chunk], batch + [no_sample], [wants_prompt_logprobs]):
        step_inputs.build_step_inputs(scheduled, BLOCK_SIZE, BlockTables(), {}, None)
    assert calls == ["decode", "mixed", "mixed", "mixed"]


def test_only_a_forgotten_sequence_of_the_step_breaks_its_row_order():
    """A sequence that finished without a row in the deferred step (it was not scheduled there)
    leaves the step's rows whole, so the next step still copies its tokens over whole."""
    pending = DeferredStep(ModelRunnerOutput(), ["a", "b", "c"], torch.tensor([7, 8, 9]))
    pending.forget("elsewhere")
    assert pending.ids_in_row_order == ["a", "b", "c"] and pending.rows == {"a": 0, "b": 1, "c": 2}
    pending.forget("b")
    assert pending.ids_in_row_order is None and pending.rows == {"a": 0, "c": 2}
    assert pending.read().sampled_token_ids == {"a": [7], "c": [9]}
