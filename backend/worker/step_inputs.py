"""A step's input tensors, built from the scheduled requests and uploaded in one copy.

A placeholder token (async scheduling: the token the step before sampled) comes from the
runner's ``last_sampled`` once that step's tokens were read; while they are still on the
device (a deferred step, backend/worker/deferred_step.py) it is gathered there instead, so the
next step is prepared and queued without waiting for the one before.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from tandem_kernels import ops as kernels
from backend.messages.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest
from backend.models.attention import AttentionMetadata
from backend.worker.block_tables import BlockTables
from backend.worker.deferred_step import DeferredStep


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_rows: list[int]  # rows of the hidden states that need logits
    logits_index: torch.Tensor  # [len(logits_rows)] the same rows, on the device
    # (request, index into logits_rows, draft offset): a request with d drafts samples d + 1 rows
    sample_rows: list[tuple[ScheduledRequest, int, int]]
    prompt_rows: list[tuple[ScheduledRequest, int, int, int]]  # (req, first index, count, first position)


def build_step_inputs(scheduled: list[ScheduledRequest], block_size: int, block_tables: BlockTables,
                      last_sampled: dict[str, int], upload: Callable,
                      pending: Optional[DeferredStep] = None) -> StepInputs:
    """pending: the deferred step whose sampled tokens (on the device) fill the placeholders of
    its sequences; a placeholder of any other sequence takes its ``last_sampled`` token."""
    build = (_decode_step_inputs if all(len(s.token_ids) == 1 and s.needs_sample
                                        and s.sampling_params.prompt_logprobs is None for s in scheduled)
             else _mixed_step_inputs)
    return build(scheduled, block_size, block_tables, last_sampled, upload, pending)


def _mixed_step_inputs(scheduled: list[ScheduledRequest], block_size: int, block_tables: BlockTables,
                       last_sampled: dict[str, int], upload: Callable, pending: Optional[DeferredStep]) -> StepInputs:
    """``build_step_inputs`` for any step (prefill chunks, drafts, prompt logprobs), sequence by sequence."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_lens: list[int] = []
    logits_rows: list[int] = []
    sample_rows: list[tuple[ScheduledRequest, int, int]] = []
    prompt_rows: list[tuple[ScheduledRequest, int, int, int]] = []
    gather_at: list[int] = []  # input rows whose token is gathered from the deferred step ...
    gather_from: list[int] = []  # ... from these rows of its sampled tokens

    pending_rows = pending.rows if pending is not None else {}

    def placeholder(request_id: str, at: int) -> int:
        row = pending_rows.get(request_id)
        if row is None:  # read already (a sequence whose sampling failed has ended: its row is dropped)
            return last_sampled.get(request_id, 0)
        gather_at.append(at)
        gather_from.append(row)
        return 0

    for s in scheduled:
        row0 = len(input_ids)
        if len(s.token_ids) == 1 and s.needs_sample and s.sampling_params.prompt_logprobs is None:
            # The common case, one decode token (no drafts): its row, position, slot and sample row.
            pos, token = s.start_pos, s.token_ids[0]
            if token == PLACEHOLDER_TOKEN_ID:  # sampled by the step before (async scheduling)
                token = placeholder(s.request_id, row0)
            input_ids.append(token)
            positions.append(pos)
            slots.append(s.block_ids[pos // bs] * bs + pos % bs)
            seq_lens.append(pos + 1)
            query_lens.append(1)
            sample_rows.append((s, len(logits_rows), 0))
            logits_rows.append(row0)
            continue
        start, n = s.start_pos, s.num_tokens
        end = start + n
        input_ids.extend(s.token_ids)
        if s.token_ids[-1] == PLACEHOLDER_TOKEN_ID:  # sampled by the step before (async scheduling)
            input_ids[-1] = placeholder(s.request_id, len(input_ids) - 1)
        positions.extend(range(start, end))
        pos = start
        while pos < end:  # slots run contiguously inside each block
            block_end = min(end, (pos // bs + 1) * bs)
            base = s.block_ids[pos // bs] * bs - (pos // bs) * bs
            slots.extend(range(base + pos, base + block_end))
            pos = block_end
        seq_lens.append(end)
        query_lens.append(n)
        if s.sampling_params.prompt_logprobs is not None and start < s.num_prompt_tokens - 1:
            # Row at position p predicts prompt token p + 1.
            last = min(end, s.num_prompt_tokens - 1)
            prompt_rows.append((s, len(logits_rows), last - start, start))
            logits_rows.extend(range(row0, row0 + last - start))
        if s.needs_sample:  # the last token's row, and each draft's
            first = row0 + n - 1 - s.num_draft_tokens
            for j in range(s.num_draft_tokens + 1):
                sample_rows.append((s, len(logits_rows), j))
                logits_rows.append(first + j)

    query_start = [0, *itertools.accumulate(query_lens)]
    i64, i32 = torch.int64, torch.int32
    tensors = upload([(input_ids, i64), (positions, i64), (slots, i64), (seq_lens, i32), (query_start, i32),
                      (block_tables.padded(scheduled), i32), (logits_rows, i64),
                      (gather_at, i64), (gather_from, i64)])
    ids, pos_t, slot_t, lens_t, starts_t, tables_t, logits_t, at_t, from_t = tensors
    if gather_at:
        ids[at_t] = pending.tokens[from_t]
    meta = AttentionMetadata(slot_mapping=slot_t, block_tables=tables_t, seq_lens=lens_t,
                             query_start_loc=starts_t, max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    # The attention's per-step plan, shared by all layers (Triton kernels read the tensors above).
    meta.plan = kernels.plan_attention(meta.block_tables, seq_lens, query_lens, bs,
                                       seq_lens_tensor=lens_t, query_start_tensor=starts_t)
    return StepInputs(input_ids=ids, positions=pos_t, meta=meta, logits_rows=logits_rows,
                      logits_index=logits_t, sample_rows=sample_rows, prompt_rows=prompt_rows)


def _decode_step_inputs(scheduled: list[ScheduledRequest], block_size: int, block_tables: BlockTables,
                        last_sampled: dict[str, int], upload: Callable, pending: Optional[DeferredStep]
                        ) -> StepInputs:
    """``build_step_inputs`` for a step of single decode tokens (no drafts, no prompt logprobs),
    the common one: the same inputs, computed as arrays over the batch rather than per sequence."""
    n = len(scheduled)
    positions = [s.start_pos for s in scheduled]
    input_ids = [s.token_ids[0] for s in scheduled]
    gather_at: list[int] = []  # rows whose token is gathered from the deferred step ...
    gather_from: list[int] = []  # ... from these rows of its sampled tokens
    all_pending = False  # every row's token is the deferred step's token in the same row
    if PLACEHOLDER_TOKEN_ID in input_ids:  # sampled by the step before (async scheduling)
        all_pending = _behind_in_order(scheduled, input_ids, pending)
        if all_pending:  # the common async decode step: the same sequences as the step before
            input_ids = [0] * n
        else:
            _fill_placeholders(scheduled, input_ids, last_sampled, pending, gather_at, gather_from)
    tables = block_tables.padded(scheduled)  # [n, width] int32
    pos = np.array(positions, dtype=np.int64)  # [n]
    slots = tables[np.arange(n), pos // block_size].astype(np.int64) * block_size + pos % block_size  # [n]
    seq_lens = [p + 1 for p in positions]
    query_lens = [1] * n
    logits_rows = list(range(n))
    i64, i32 = torch.int64, torch.int32
    ids, pos_t, slot_t, lens_t, starts_t, tables_t, logits_t, at_t, from_t = upload(
        [(input_ids, i64), (pos, i64), (slots, i64), (seq_lens, i32), (np.arange(n + 1, dtype=np.int32), i32),
         (tables, i32), (logits_rows, i64), (gather_at, i64), (gather_from, i64)])
    if all_pending:
        ids.copy_(pending.tokens)
    elif gather_at:
        ids[at_t] = pending.tokens[from_t]
    meta = AttentionMetadata(slot_mapping=slot_t, block_tables=tables_t, seq_lens=lens_t,
                             query_start_loc=starts_t, max_query_len=1, max_seq_len=max(seq_lens))
    meta.plan = kernels.plan_attention(meta.block_tables, seq_lens, query_lens, block_size,
                                       seq_lens_tensor=lens_t, query_start_tensor=starts_t)
    return StepInputs(input_ids=ids, positions=pos_t, meta=meta, logits_rows=logits_rows, logits_index=logits_t,
                      sample_rows=list(zip(scheduled, logits_rows, itertools.repeat(0))), prompt_rows=[])


def _behind_in_order(scheduled: list[ScheduledRequest], input_ids: list[int], pending: Optional[DeferredStep]) -> bool:
    """Whether every row is a placeholder for the deferred step's token in the same row."""
    in_order = pending.ids_in_row_order if pending is not None else None
    return (in_order is not None and len(in_order) == len(scheduled)
            and input_ids.count(PLACEHOLDER_TOKEN_ID) == len(scheduled)
            and [s.request_id for s in scheduled] == in_order)


def _fill_placeholders(scheduled: list[ScheduledRequest], input_ids: list[int], last_sampled: dict[str, int],
                       pending: Optional[DeferredStep], gather_at: list[int], gather_from: list[int]) -> None:
    """Row by row: a placeholder takes its sequence's ``last_sampled`` token if its step was read
    already, else 0 now and the deferred step's token later (appended to gather_at/gather_from)."""
    pending_rows = pending.rows if pending is not None else {}
    for row, s in enumerate(scheduled):
        if input_ids[row] == PLACEHOLDER_TOKEN_ID:
            pending_row = pending_rows.get(s.request_id)
            if pending_row is None:  # read already
                input_ids[row] = last_sampled.get(s.request_id, 0)
            else:
                gather_at.append(row)
                gather_from.append(pending_row)
                input_ids[row] = 0
