"""What the engine sends back: per-step output deltas, logprobs, finish reasons, model info, load.

Pure Python (no torch): the data contract between the two halves, in process or over gRPC.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class FinishReason(str, enum.Enum):
    """Why a sequence ended; the string values are OpenAI's."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # cancelled by the client or the server


@dataclass
class Logprob:
    """Log-probability of one token under the model's raw distribution."""

    logprob: float
    rank: Optional[int] = None  # 1 = most likely
    decoded_token: Optional[str] = None  # filled in by the frontend


# One position: token ID -> Logprob; the chosen token first, then the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class EngineOutput:
    """What one sequence produced in one engine step (a delta, not a total).

    A request with ``n > 1`` runs as ``n`` sequences; ``index`` tells them apart.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: Optional[list[PositionLogprobs]] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[int] = None  # the stop token ID that ended it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Sent once, with the sequence's first delta; position 0 is None.
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    # Set (with finish_reason ABORT) when the request failed inside the engine: what went wrong.
    # Every unfinished sequence of that request gets one; ``AsyncLLMEngine`` raises it as a
    # ``RequestFailedError``.
    error: Optional[str] = None
    # An embedding request's pooled hidden state (fp32), with its final output.
    pooled: Optional[list[float]] = None
    # time.monotonic() when the sequence was first scheduled (its queue time ended); with its first delta.
    # A timestamp for the backend's metrics, not part of what was produced: outputs compare without it.
    scheduled_time: Optional[float] = field(default=None, compare=False, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ModelInfo:
    """What a client needs to know about the served model."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    tokenizer_path: Optional[str] = None  # a local directory holding the tokenizer files
    hidden_size: Optional[int] = None  # the length of an embedding vector (None: not known)


@dataclass
class EngineLoad:
    """A snapshot of the engine's load, for routing and metrics."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float  # 0.0 .. 1.0
