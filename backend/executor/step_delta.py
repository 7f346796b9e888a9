"""The per-step message from the engine to worker processes: only what changed since the last one.

The engine's ``SchedulerOutput`` names every scheduled request with its whole prompt, outputs and
block table. Sending that each step would grow with the context, so the driver sends a delta and
each worker keeps a mirror of the running requests and rebuilds the same ``SchedulerOutput``::

    StepMessage
      finished_request_ids   dropped from the mirror first (an ID may come back new in the same step)
      new_requests           NewRequest: prompt, sampling params, EOS -- once per request
      scheduled              ScheduledDelta per request: where this step starts and how many tokens,
                             the tokens appended since it was last sent (decode: one),
                             its block table as (blocks to keep, blocks to append after them),
                             this step's speculative drafts (never stored: they change each step)
      grammar                the step's structured-output masks (SchedulerOutput.grammar) or None:
                             per constrained sampling row, vocab / 8 bytes, whatever the context

A decode step therefore costs a few dozen bytes per request whatever the context length. After a
preemption the block table is rebuilt (fewer blocks kept); tokens are never taken back.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from backend.messages.scheduler_output import ScheduledRequest, SchedulerOutput
from backend.types.sampling_params import SamplingParams


class NewRequest(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]


class ScheduledDelta(NamedTuple):
    request_id: str
    start_pos: int
    num_tokens: int  # drafts included
    needs_sample: bool
    new_token_ids: list[int]  # output tokens appended since the request was last sent
    keep_blocks: int  # leading entries of the mirrored block table that stay
    new_block_ids: list[int]  # appended after them
    draft_token_ids: list[int]  # the last len() of this step's tokens: drafts to verify


class StepMessage(NamedTuple):
    finished_request_ids: list[str]
    new_requests: list[NewRequest]
    scheduled: list[ScheduledDelta]
    num_scheduled_tokens: int
    num_preempted: int
    grammar: Any  # SchedulerOutput.grammar, as is


class _Sent:
    """What the workers know of one request."""

    __slots__ = ("num_outputs", "block_ids")

    def __init__(self) -> None:
        self.num_outputs = 0
        self.block_ids: list[int] = []


class StepEncoder:
    """Driver side: ``SchedulerOutput`` -> ``StepMessage``, remembering what was sent."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, sched: SchedulerOutput) -> StepMessage:
        finished = list(sched.finished_request_ids)
        for request_id in finished:
            self._sent.pop(request_id, None)
        new_requests, scheduled = [], []
        for s in sched.scheduled:
            sent = self._sent.get(s.request_id)
            if sent is None:
                sent = self._sent[s.request_id] = _Sent()
                new_requests.append(NewRequest(s.request_id, s.prompt_token_ids, s.sampling_params,
                                               s.eos_token_id))
            new_tokens = s.output_token_ids[sent.num_outputs:]
            sent.num_outputs += len(new_tokens)
            keep = _common_prefix(sent.block_ids, s.block_ids)
            new_blocks = s.block_ids[keep:]
            del sent.block_ids[keep:]
            sent.block_ids.extend(new_blocks)
            drafts = s.token_ids[s.num_tokens - s.num_draft_tokens:] if s.num_draft_tokens else []
            scheduled.append(ScheduledDelta(s.request_id, s.start_pos, s.num_tokens, s.needs_sample,
                                            new_tokens, keep, new_blocks, drafts))
        return StepMessage(finished, new_requests, scheduled, sched.num_scheduled_tokens,
                           sched.num_preempted, sched.grammar)


def _common_prefix(sent: list[int], now: list[int]) -> int:
    """How many leading blocks ``now`` shares with what was sent (all of them, unless the
    request was preempted and its table rebuilt)."""
    if now[:len(sent)] == sent:
        return len(sent)
    keep = 0
    while keep < min(len(sent), len(now)) and sent[keep] == now[keep]:
        keep += 1
    return keep


class _Mirror:
    __slots__ = ("prompt_token_ids", "output_token_ids", "all_token_ids", "block_ids",
                 "sampling_params", "eos_token_id")

    def __init__(self, new: NewRequest) -> None:
        self.prompt_token_ids = list(new.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(new.prompt_token_ids)
        self.block_ids: list[int] = []
        self.sampling_params = new.sampling_params
        self.eos_token_id = new.eos_token_id


class StepDecoder:
    """Worker side: ``StepMessage`` -> the ``SchedulerOutput`` the driver's scheduler produced."""

    def __init__(self) -> None:
        self._requests: dict[str, _Mirror] = {}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def decode(self, message: StepMessage) -> SchedulerOutput:
        for request_id in message.finished_request_ids:
            self._requests.pop(request_id, None)
        for new in message.new_requests:
            self._requests[new.request_id] = _Mirror(new)
        scheduled = []
        for d in message.scheduled:
            m = self._requests[d.request_id]
            if d.new_token_ids:
                m.output_token_ids.extend(d.new_token_ids)
                m.all_token_ids.extend(d.new_token_ids)
            if d.keep_blocks < len(m.block_ids):  # rebuilt: a new list (ScheduledRequest.block_ids)
                m.block_ids = m.block_ids[:d.keep_blocks]
            m.block_ids.extend(d.new_block_ids)
            known_end = d.start_pos + d.num_tokens - len(d.draft_token_ids)
            scheduled.append(ScheduledRequest(
                request_id=d.request_id,
                token_ids=m.all_token_ids[d.start_pos:known_end] + d.draft_token_ids,
                start_pos=d.start_pos, block_ids=m.block_ids, needs_sample=d.needs_sample,
                sampling_params=m.sampling_params, prompt_token_ids=m.prompt_token_ids,
                output_token_ids=m.output_token_ids, eos_token_id=m.eos_token_id,
                num_draft_tokens=len(d.draft_token_ids)))
        return SchedulerOutput(scheduled=scheduled, num_scheduled_tokens=message.num_scheduled_tokens,
                               finished_request_ids=set(message.finished_request_ids),
                               num_preempted=message.num_preempted, grammar=message.grammar)
