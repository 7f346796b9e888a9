"""A launched step whose sampled tokens are still on the device.

Under async scheduling the runner may return from a step before its tokens reach the host:
its kernels are queued, its tokens are copied into pinned memory behind them, and an event
marks the copy. The next step is prepared and queued meanwhile (its placeholder tokens are
gathered from ``tokens`` on the device, backend/worker/step_inputs.py); ``read`` waits for the
event (the GIL released) and completes the step's output. Only plain decode steps are
deferred (``deferral``): anything that needs a step's tokens on the host before the next
step runs, or reads the device while sampling, runs as before.
"""

from __future__ import annotations

from typing import Optional

import torch

from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import SchedulerOutput


GREEDY, DRAWN = "greedy", "drawn"


def deferral(sched: SchedulerOutput) -> Optional[str]:
    """Whether the step can be deferred: every sequence decodes one token, greedy or drawn
    (temperature, top-k, min-p, seeds), with or without penalties, logit_bias and min_tokens
    (their tables and parameters are on the device: the runner counts the step's tokens there),
    and nothing needs it on the host before the next step: no logprobs, grammar, drafts or
    pooling, and no top-p (its wide-nucleus fallback reads the device). GREEDY: every token is
    its logits' argmax; DRAWN: some need sampling rows; None: not deferrable."""
    if not sched.scheduled or sched.grammar is not None:
        return None
    drawn = False
    for s in sched.scheduled:
        if not s.needs_sample or s.num_draft_tokens or len(s.token_ids) != 1:
            return None
        on_device = s.sampling_params.samples_on_device  # cached per request
        if on_device is None:
            return None
        drawn = drawn or on_device
    return DRAWN if drawn else GREEDY


class DeferredStep:
    def __init__(self, out: ModelRunnerOutput, request_ids: list[str], tokens: torch.Tensor,
                 penalties_counted: bool = False) -> None:
        """tokens: [len(request_ids)] int64, each sequence's sampled token, on the device.
        penalties_counted: the penalized sequences' tokens are counted in the runner's penalty
        history already (on the device), not to be counted again when read."""
        self.out = out
        self.penalties_counted = penalties_counted
        self.request_ids = request_ids  # in row order
        self.forgotten: set[str] = set()
        self._rows: Optional[dict[str, int]] = None
        self.tokens = tokens
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host, self._copied = tokens, None

    @property
    def rows(self) -> dict[str, int]:
        """Each remaining (not forgotten) sequence's row of ``tokens``."""
        if self._rows is None:
            self._rows = {request_id: row for row, request_id in enumerate(self.request_ids)
                          if request_id not in self.forgotten}
        return self._rows

    @property
    def ids_in_row_order(self) -> Optional[list[str]]:
        """Every sequence's ID in row order, if none of them was forgotten (else None: see ``rows``)."""
        if self.forgotten and not self.forgotten.isdisjoint(self.request_ids):
            return None
        return self.request_ids

    def forget(self, request_id: str) -> None:
        """The sequence ended before its token was read: it gets none."""
        self.forgotten.add(request_id)
        if self._rows is not None:
            self._rows.pop(request_id, None)

    def read(self) -> ModelRunnerOutput:
        """Wait for the tokens; the step's output with each remaining sequence's token."""
        if self._copied is not None:
            self._copied.synchronize()
        values = self._host.tolist()
        sampled, forgotten = self.out.sampled_token_ids, self.forgotten
        if forgotten:
            sampled.update((request_id, [value]) for request_id, value in zip(self.request_ids, values)
                           if request_id not in forgotten)
        else:
            sampled.update(zip(self.request_ids, [[value] for value in values]))
        return self.out
