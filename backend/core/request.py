"""The engine's own state of one sequence (private to the engine: never crosses a process boundary)."""

from __future__ import annotations

import enum
import time
from typing import Optional

from backend.types.outputs import FinishReason, PositionLogprobs
from backend.types.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


class Request:
    """One sequence inside the engine: its tokens and how far the KV cache covers them.

    The scheduler moves ``num_computed_tokens`` towards ``num_tokens``; nothing
    else marks a request as prefilling or decoding.
    """

    # Slots: the engine touches a few of these per sequence per step (hundreds of sequences).
    __slots__ = ("request_id", "parent_id", "index", "prompt_token_ids", "sampling_params", "eos_token_id",
                 "arrival_time", "cache_salt", "status", "output_token_ids", "all_token_ids",
                 "num_computed_tokens", "num_inflight_tokens", "num_placeholders", "num_cached_tokens",
                 "num_preemptions", "block_hashes", "finish_reason", "stop_reason", "prompt_logprobs",
                 "first_token_time", "scheduled_time", "draft_token_ids", "stop_filter", "preempted_at")

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: Optional[int],
        parent_id: Optional[str] = None,
        index: int = 0,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.cache_salt = cache_salt  # keys its prefix-cache blocks apart from other salts
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens scheduled in steps whose results the engine has not processed yet (their KV is
        # being computed), and tokens sampled there but not known yet (placeholders: at most one
        # per step in flight). Both are 0 between steps of the synchronous engine.
        self.num_inflight_tokens = 0
        self.num_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first schedule
        self.num_preemptions = 0
        # The scheduler's num_preemptions_total just after this sequence's last preemption (0: never).
        self.preempted_at = 0
        self.block_hashes: list[bytes] = []  # chained digests of full blocks, see BlockManager
        self.finish_reason: Optional[FinishReason] = None
        self.stop_reason: Optional[int] = None
        self.prompt_logprobs: list[Optional[PositionLogprobs]] = []
        self.first_token_time: Optional[float] = None
        self.scheduled_time: Optional[float] = None  # time.monotonic() of its first schedule
        # Speculative tokens proposed for the next step (not part of the sequence until accepted).
        self.draft_token_ids: list[int] = []
        # What can end it on a decode token (backend.engine.decode_step.stop_filter), once asked.
        self.stop_filter: Optional[tuple[frozenset, int]] = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def complete_step(self, num_scheduled: int, num_rejected: int, sampled: bool, stale: bool = False) -> None:
        """A step's results for this sequence are in: ``num_scheduled`` tokens left flight and all
        but ``num_rejected`` (drafts) are in the KV cache now; ``sampled``: its placeholder is
        resolved (the caller appends the tokens). ``stale``: the sequence was preempted after
        the step was scheduled, so its KV cache is gone and nothing counts as computed."""
        if not stale:
            self.num_inflight_tokens -= num_scheduled
            self.num_computed_tokens += num_scheduled - num_rejected
        if sampled:
            self.num_placeholders -= 1

    def record_prompt_logprobs(self, first_pos: int, logprobs: list) -> None:
        """Record the logprobs of prompt tokens first_pos.. that are not there yet: after a
        preemption the prompt is computed again from 0, in chunks that may end elsewhere than
        before, so a chunk can cover positions already recorded, new ones, or both."""
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)  # the first prompt token has none
        known = len(self.prompt_logprobs)
        if first_pos <= known < first_pos + len(logprobs):
            self.prompt_logprobs.extend(logprobs[known - first_pos:])

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
