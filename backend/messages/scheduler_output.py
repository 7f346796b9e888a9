"""The scheduler's decision for one step: which tokens of which sequences run (read-only downstream).

The engine hands it to the executor, which hands it (or, across processes, a delta it rebuilds
from: ``backend.executor.step_delta``) to every worker's model runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from backend.types.sampling_params import SamplingParams

# Stands in ``ScheduledRequest.token_ids`` for a token sampled by the step still in flight (async
# scheduling): the model runner puts that step's sampled token in its place.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step, as the model runner needs it (read-only there)."""

    request_id: str
    # The tokens to compute this step; the last num_draft_tokens are drafts. With async scheduling
    # the last may be PLACEHOLDER_TOKEN_ID: the token this sequence samples in the step before.
    token_ids: list[int]
    start_pos: int  # position of token_ids[0] (= num_computed_tokens before the step)
    # The request's whole block table. While it is the same list object it only grows by appending;
    # a table rebuilt (after a preemption) is a new list (the runner's BlockTables rely on it).
    block_ids: list[int]
    needs_sample: bool  # this step reaches the last known token: sample the next one
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: Optional[int]
    num_draft_tokens: int = 0  # speculative tokens to verify after the request's last token
    # Output tokens before this step's sample (placeholders included), fixed when scheduled:
    # ``output_token_ids`` may still grow meanwhile (async scheduling). None: its length.
    num_output_tokens: Optional[int] = None

    @property
    def num_prior_outputs(self) -> int:
        return len(self.output_token_ids) if self.num_output_tokens is None else self.num_output_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    # Requests that ended since the last step: the runner drops their state (RNGs).
    finished_request_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0
    # Allowed tokens of the constrained sequences that sample this step
    # (backend.structured_output.GrammarBitmask), filled in by the engine; None: none.
    grammar: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
