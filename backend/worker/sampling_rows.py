"""A step's sampling rows, built from its scheduled requests, and kept for the next step while
the batch stays the same.

At batch 256 with penalties, building a ``SamplingRow`` per sequence, looking up each penalized
sequence's history slot and uploading the penalties' per-row parameters took most of a decode
step's host time, though decode steps sample the same sequences, in the same order, step after
step. So a step whose sequences sample one row each (no drafts) is kept (``SampledBatch``: its
rows, slots and the sampler's ``RowClasses`` with the parameters it uploaded) and reused by the
next step while that samples the same request IDs in the same order and no request has finished
since. That is exact because a sequence's parameters, RNG and history slot are fixed from its
first step to its finish, and a slot is freed, or a request ID taken by another request, only
after that finish reaches the runner (``finished_request_ids``, which clears the kept batch).
What moves per step is refreshed: the output count of the rows with ``min_tokens``, and the
tokens recorded in the penalty history since (flushed; a kept batch's own tokens are counted on
the device as they are sampled, ``Sampler``'s ``count``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from backend.messages.scheduler_output import ScheduledRequest
from backend.worker.penalty_history import PenaltyHistory
from backend.worker.sampler import RowClasses, SamplingRow, classify


@dataclass(slots=True)
class SampledBatch:
    """The sampling rows of one step, in the order of its sample rows."""

    request_ids: list[str]  # per row (a request with drafts has several rows)
    rows: list[SamplingRow]
    slots: dict[str, int]  # request ID -> its penalty history slot, for the penalized requests
    classes: RowClasses
    one_row_each: bool  # no request has drafts: request_ids are distinct


class SamplingRows:
    """Per-sequence sampling state the runner keeps (seeded RNGs, the penalty history) and the
    rows built from it each step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.history: Optional[PenaltyHistory] = None  # made at the first penalized request
        self._last: Optional[SampledBatch] = None  # the last one-row-each batch, for the next step

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished sequences (their RNGs and history slots); any finish clears the kept
        batch (a freed slot or request ID may go to another request)."""
        request_ids = list(request_ids)
        if not request_ids:
            return
        self._last = None
        for request_id in request_ids:
            self.generators.pop(request_id, None)
        if self.history is not None:
            self.history.release(request_ids)

    def forget_batch(self) -> None:
        """Keep no batch for the next step (after a failed one)."""
        self._last = None

    def batch(self, sample_rows: list[tuple[ScheduledRequest, int, int]], vocab_size: int) -> SampledBatch:
        """The rows of a step's (request, logits row, draft offset) sample rows, each penalized
        request with its outputs so far counted in ``history``."""
        request_ids = [s.request_id for s, _, _ in sample_rows]
        last = self._last
        if last is not None and request_ids == last.request_ids:  # one row each, as kept
            rows = last.rows
            for i in last.classes.min_tokens:  # their output count moves every step
                s = sample_rows[i][0]
                rows[i].output_token_ids = s.output_token_ids
                rows[i].num_output_tokens = s.num_prior_outputs
            if last.slots:
                self.history.flush()  # the tokens recorded since the last step
            return last
        slots = self.penalty_slots([s for s, _, j in sample_rows if not j], vocab_size)
        rows, one_row_each = [], True
        for s, _, j in sample_rows:
            params = s.sampling_params
            if j or s.num_draft_tokens:
                one_row_each = False
            if j or (params.seed is not None and not params.greedy):
                rows.append(self.row(s, j, slots))
            else:  # the common row (no draft before it, no seed), built inline
                rows.append(SamplingRow(params, s.prompt_token_ids, s.output_token_ids, s.eos_token_id, None,
                                        slots.get(s.request_id), (), s.num_prior_outputs))
        batch = SampledBatch(request_ids, rows, slots, classify(rows), one_row_each)
        self._last = batch if one_row_each else None
        return batch

    def penalty_slots(self, requests: list[ScheduledRequest], vocab_size: int) -> dict[str, int]:
        """Request ID -> its row in ``history``, for the requests with penalties, each with its
        outputs so far counted (only the new ones are added: O(new tokens))."""
        penalized = [s for s in requests if s.sampling_params.has_penalties]
        if not penalized:
            return {}
        if self.history is None:
            self.history = PenaltyHistory(vocab_size, self.device)
        slots = self.history.update([(s.request_id, s.prompt_token_ids, s.output_token_ids,
                                      s.num_prior_outputs) for s in penalized])
        return {s.request_id: slot for s, slot in zip(penalized, slots)}

    def row(self, s: ScheduledRequest, draft_offset: int, penalty_slots: dict[str, int]) -> SamplingRow:
        """Sample row ``draft_offset`` of request ``s`` (the drafts before it count as outputs)."""
        drafts = s.token_ids[len(s.token_ids) - s.num_draft_tokens:][:draft_offset] if draft_offset else ()
        return SamplingRow(params=s.sampling_params, prompt_token_ids=s.prompt_token_ids,
                           output_token_ids=_history(s, draft_offset), eos_token_id=s.eos_token_id,
                           generator=self.generator(s), penalty_slot=penalty_slots.get(s.request_id),
                           extra_history=drafts, num_output_tokens=s.num_prior_outputs + draft_offset)

    def generator(self, s: ScheduledRequest) -> Optional[torch.Generator]:
        """A seeded, non-greedy request's RNG, made at its first step and kept to its finish."""
        seed = s.sampling_params.seed
        if seed is None or s.sampling_params.greedy:
            return None
        gen = self.generators.get(s.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[s.request_id] = gen
        return gen


def _history(s: ScheduledRequest, draft_offset: int) -> list[int]:
    """The output tokens before sample row ``draft_offset`` of a request (drafts before it count)."""
    if not draft_offset:
        return s.output_token_ids
    return s.output_token_ids[:s.num_prior_outputs] + s.token_ids[len(s.token_ids) - s.num_draft_tokens:][:draft_offset]
