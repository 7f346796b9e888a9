"""The scheduler: which tokens of which requests run in the next step.

No prefill or decode phase: each request has ``num_tokens`` and
``num_computed_tokens``, and every step hands out a token budget to close the
gap, running requests first (in arrival order), then waiting ones. A long
prompt takes several steps (chunked prefill); a prefix-cache hit just starts
with a larger ``num_computed_tokens``. When the KV cache is full the newest
running request is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

from collections import deque

from backend.core.block_manager import BlockManager
from backend.core.request import Request, RequestStatus
from backend.messages.scheduler_output import ScheduledRequest, SchedulerOutput
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
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.draft_token_ids and num_new == request.num_tokens - request.num_computed_tokens:
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
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
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
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _make_scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        drafts = request.draft_token_ids
        end = start + num_new - len(drafts)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end] + drafts,
            start_pos=start,
            block_ids=self.block_manager.block_ids(request.request_id),
            needs_sample=end == request.num_tokens,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_id=request.eos_token_id,
            num_draft_tokens=len(drafts),
        )
