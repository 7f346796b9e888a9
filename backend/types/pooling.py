"""How an embedding request pools the model's final hidden states (torch-free, shared types)."""

from __future__ import annotations

from dataclasses import dataclass

from backend.types.errors import InvalidRequestError

POOLING_TYPES = ("last", "mean", "cls")  # vLLM's names; "last" is its default for causal LMs


@dataclass(frozen=True)
class PoolingParams:
    """``type``: ``last`` (the last prompt token's hidden state), ``mean`` (the mean over every
    prompt token) or ``cls`` (the first prompt token's hidden state); ``normalize``: scale the pooled fp32 vector to unit L2 norm."""

    type: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.type not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, "
                                      f"not {self.type!r}.", param="pooling_type")
