"""Sampling rows and logits for the sampler tests (tests/test_sampler.py, test_penalized_argmax.py)."""

from __future__ import annotations

import torch

from backend.types.sampling_params import SamplingParams
from backend.worker.sampler import SamplingRow

VOCAB = 200


def make_row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: int | None = None,
    seed: int | None = None,
    **params,
) -> SamplingRow:
    sampling_params = SamplingParams(seed=seed, **params)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(sampling_params, prompt or [1, 2, 3], output or [], eos, generator)


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def counts_of(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab)
