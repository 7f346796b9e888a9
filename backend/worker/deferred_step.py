"""A launched step whose sampled tokens are still on the device.

Under async scheduling the runner may return from a step before its tokens reach the host:
its kernels are queued, its tokens are copied into pinned memory behind them, and an event
marks the copy. The next step is prepared and queued meanwhile (its placeholder tokens are
gathered from ``tokens`` on the device, backend/worker/step_inputs.py); ``read`` waits for the
event (the GIL released) and completes the step's output. Only plain decode steps are
deferred (``can_defer``): anything that needs a step's tokens on the host before the next
step runs, or reads the device while sampling, runs as before.
"""

from __future__ import annotations

import torch

from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import SchedulerOutput
from backend.types.sampling_params import SamplingParams


def can_defer(sched: SchedulerOutput) -> bool:
    """Every sequence decodes one token, greedy or drawn (temperature, top-k, min-p, seeds), and
    nothing needs it on the host before the next step: no logprobs, penalties, logit_bias,
    min_tokens, grammar, drafts or pooling, and no top-p (its wide-nucleus fallback reads the
    device)."""
    return bool(sched.scheduled) and sched.grammar is None and all(
        s.needs_sample and len(s.token_ids) == 1 and not s.num_draft_tokens
        and _deferrable(s.sampling_params) for s in sched.scheduled)


def _deferrable(params: SamplingParams) -> bool:
    if params.prompt_logprobs is not None or params.pooling is not None:
        return False
    return params.argmax_only or (not params.wants_logprobs and not params.has_penalties and not params.logit_bias
                                  and params.min_tokens == 0 and params.top_p >= 1.0)


class DeferredStep:
    def __init__(self, out: ModelRunnerOutput, request_ids: list[str], tokens: torch.Tensor) -> None:
        """tokens: [len(request_ids)] int64, each sequence's sampled token, on the device."""
        self.out = out
        self.rows = {request_id: row for row, request_id in enumerate(request_ids)}
        self.tokens = tokens
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host, self._copied = tokens, None

    def forget(self, request_id: str) -> None:
        """The sequence ended before its token was read: it gets none."""
        self.rows.pop(request_id, None)

    def read(self) -> ModelRunnerOutput:
        """Wait for the tokens; the step's output with each remaining sequence's token."""
        if self._copied is not None:
            self._copied.synchronize()
        values = self._host.tolist()
        for request_id, row in self.rows.items():
            self.out.sampled_token_ids[request_id] = [values[row]]
        return self.out
