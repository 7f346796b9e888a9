"""What one step of the model runner returns to the engine: sampled tokens, logprobs, failures."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.types.outputs import PositionLogprobs


@dataclass
class ModelRunnerOutput:
    # request ID -> the tokens its sequence gains this step: one, or with speculative drafts the
    # accepted drafts then the model's own next token (and their logprobs, when asked for)
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # request ID -> (first prompt position covered, logprobs of prompt tokens from there)
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    # request ID -> why its sampling or logprobs failed this step (it has no entry above); the
    # engine ends that request alone
    failed: dict[str, str] = field(default_factory=dict)
    # request ID -> its pooled final hidden state (fp32), on the step that computed its last prompt
    # token (requests with SamplingParams.pooling only; see backend/worker/pooler.py)
    pooled: dict[str, list[float]] = field(default_factory=dict)
