"""Pooling of final hidden states for embedding requests (``SamplingParams.pooling``).

A pooling request runs through the scheduler like any prompt, possibly in several chunks; each
step the runner hands this module the step's hidden states, and on the step that computes the
last prompt token the pooled vector goes into ``ModelRunnerOutput.pooled``. Mean pooling keeps an
fp32 running sum per request between chunks, CLS pooling the first token's row; a chunk starting
at position 0 (a first run, or a run again after preemption) starts either afresh. Both need
every prompt position computed here (the engine gives such requests a cache salt of their own).
"""

from __future__ import annotations

import torch

from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import ScheduledRequest


class Pooler:
    def __init__(self) -> None:
        # request ID -> [hidden] fp32: mean pooling's sum of rows so far, CLS pooling's first row
        self._sums: dict[str, torch.Tensor] = {}

    def step(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Pool this step's rows (hidden: [num_tokens, hidden], rows in ``scheduled`` order)."""
        row0 = 0
        for s in scheduled:
            pooling = s.sampling_params.pooling
            if pooling is not None:
                self._pool(s, pooling, hidden[row0:row0 + s.num_tokens], out)
            row0 += s.num_tokens

    def _pool(self, s: ScheduledRequest, pooling, rows: torch.Tensor, out: ModelRunnerOutput) -> None:
        # rows: [num_tokens, hidden], positions s.start_pos .. s.start_pos + num_tokens - 1
        end = s.start_pos + s.num_tokens
        if pooling.type == "mean":
            if s.start_pos == 0:
                self._sums[s.request_id] = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
            total = self._sums.get(s.request_id)
            if total is None:  # its first positions were never computed here (a prefix-cache hit)
                out.failed[s.request_id] = "Mean pooling needs every prompt position computed."
                return
            total += rows[:max(0, min(end, s.num_prompt_tokens) - s.start_pos)].float().sum(0)
        elif pooling.type == "cls" and s.start_pos == 0:
            self._sums[s.request_id] = rows[0].float()
        if end < s.num_prompt_tokens:
            return
        if pooling.type == "mean":
            vector = self._sums.pop(s.request_id) / s.num_prompt_tokens
        elif pooling.type == "cls":
            vector = self._sums.pop(s.request_id, None)
            if vector is None:  # its first position was never computed here (a prefix-cache hit)
                out.failed[s.request_id] = "CLS pooling needs the first prompt position computed."
                return
        else:
            vector = rows[s.num_prompt_tokens - 1 - s.start_pos].float()
        if pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        out.pooled[s.request_id] = vector.cpu().tolist()

    def release(self, request_ids) -> None:
        """Forget finished (or aborted) requests' partial sums."""
        for request_id in request_ids:
            self._sums.pop(request_id, None)
