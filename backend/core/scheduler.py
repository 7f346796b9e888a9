"""The scheduler: which tokens of which requests run in the next step.

No prefill or decode phase: each request has ``num_tokens`` and
``num_computed_tokens``, and every step hands out a token budget to close the
gap, running requests first (in arrival order), then waiting ones. A long
prompt takes several steps (chunked prefill); a prefix-cache hit just starts
with a larger ``num_computed_tokens``. When the KV cache is full the newest
running request is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

from backend.core.block_manager import BlockManager
from backend.core.request import Request, RequestStatus
from backend.messages.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from backend.types.outputs import FinishReason


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions_total = 0

    # ---- queue management ----------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request: Request, reason: FinishReason) -> None:
        """End a request (any state): free its blocks and forget it."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.block_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preempted = 0

        i = 0
        running = self.running
        while i < len(running) and budget > 0:
            i, budget = self._schedule_decodes(i, budget, scheduled)
            if i == len(running) or not budget:
                break
            request = running[i]
            known, placeholders = request.all_token_ids, request.num_placeholders
            start = request.num_computed_tokens + request.num_inflight_tokens
            left = len(known) + placeholders - start  # tokens neither computed nor in flight
            if left <= 0 or (placeholders and self._at_length_limit(request)):
                i += 1  # everything is in flight, or its last token is
                continue
            num_new = min(left, budget)
            if request.draft_token_ids:
                if num_new == left:
                    # Decoding with drafts: verify as many as the budget allows, after the last token.
                    del request.draft_token_ids[budget - num_new:]
                    num_new += len(request.draft_token_ids)
                else:
                    request.draft_token_ids.clear()
            while not self.block_manager.allocate_slots(request, num_new):
                if request.draft_token_ids:  # speculation never costs another request its place
                    num_new -= len(request.draft_token_ids)
                    request.draft_token_ids.clear()
                    continue
                victim = self.running.pop()  # newest first; never one scheduled before i
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append(self._make_scheduled(request, num_new))
                budget -= num_new
                i += 1

        # Admit waiting requests, unless memory just ran out.
        while (self.waiting and budget > 0 and not num_preempted
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            if request.num_placeholders:  # preempted with a token in flight: wait until it is known
                break
            hits, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:
                hits, num_hit_tokens = self.block_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:  # its first schedule
                request.num_cached_tokens = num_hit_tokens
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._make_scheduled(request, num_new))
            budget -= num_new

        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(scheduled=scheduled,
                               num_scheduled_tokens=self.max_num_batched_tokens - budget,
                               finished_request_ids=finished, num_preempted=num_preempted)

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks; it goes back to the front of the queue."""
        self.block_manager.free(request)
        request.draft_token_ids.clear()
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_inflight_tokens = 0  # an in-flight step's results for it keep only the token
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        request.preempted_at = self.num_preemptions_total
        self.waiting.appendleft(request)

    def _at_length_limit(self, request: Request) -> bool:
        """Whether the tokens in flight already take the sequence to its length limit."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and request.num_output_tokens + request.num_placeholders >= max_tokens:
            return True
        return request.num_tokens + request.num_placeholders >= self.max_model_len

    def _schedule_decodes(self, i: int, budget: int, scheduled: list[ScheduledRequest]) -> tuple[int, int]:
        """Schedule ``running[i:]`` in order while each is the common case, one decode token (no
        drafts, not at its length limit) that fits in the blocks it holds or one more free block:
        ``_make_scheduled`` for one token at its end, in one loop over the batch. Returns (the
        index of the first request that needs the general rule (a preemption among others), or
        the end; the budget left)."""
        running, block_size, max_model_len = self.running, self.block_manager.block_size, self.max_model_len
        req_blocks_get, allocate_slots = self.block_manager.req_blocks.get, self.block_manager.allocate_slots
        append = scheduled.append
        first, end = i, min(len(running), i + budget)  # one token each
        while i < end:
            request = running[i]
            known, placeholders = request.all_token_ids, request.num_placeholders
            start = request.num_computed_tokens + request.num_inflight_tokens
            num_known = len(known)
            if num_known + placeholders - start != 1 or request.draft_token_ids:
                break
            output_ids = request.output_token_ids
            if placeholders:  # _at_length_limit, inline
                max_tokens = request.sampling_params.max_tokens
                if ((max_tokens is not None and len(output_ids) + placeholders >= max_tokens)
                        or num_known + placeholders >= max_model_len):
                    break
            held = req_blocks_get(request.request_id)
            if held is None:
                break
            if start >= len(held) * block_size and not allocate_slots(request, 1):
                break  # no free block: the general rule preempts
            append(ScheduledRequest(
                request.request_id, [known[start]] if start < num_known else [PLACEHOLDER_TOKEN_ID],
                start, held, True, request.sampling_params, request.prompt_token_ids, output_ids,
                request.eos_token_id, 0, len(output_ids) + placeholders))
            request.num_inflight_tokens += 1
            request.num_placeholders = placeholders + 1
            i += 1
        return i, budget - (i - first)

    def _make_scheduled(self, request: Request, num_new: int, block_ids: Optional[list[int]] = None
                        ) -> ScheduledRequest:
        """The step's share of ``request`` (num_new tokens, drafts included); counts them in flight.
        ``block_ids``: its block table, if the caller holds it."""
        start = request.num_computed_tokens + request.num_inflight_tokens
        drafts = request.draft_token_ids
        end = start + num_new - len(drafts)
        num_known = len(request.all_token_ids)
        token_ids = request.all_token_ids[start:end]
        if end > num_known:  # the token the step in flight samples (one at most)
            token_ids.extend([PLACEHOLDER_TOKEN_ID] * (end - max(start, num_known)))
        needs_sample = end == num_known + request.num_placeholders
        scheduled = ScheduledRequest(
            request.request_id,
            token_ids + drafts if drafts else token_ids,
            start,
            block_ids if block_ids is not None else self.block_manager.block_ids(request.request_id),
            needs_sample,
            request.sampling_params,
            request.prompt_token_ids,
            request.output_token_ids,
            request.eos_token_id,
            len(drafts),
            len(request.output_token_ids) + request.num_placeholders,
        )
        request.num_inflight_tokens += num_new
        request.num_placeholders += needs_sample
        return scheduled

