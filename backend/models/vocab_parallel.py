"""Token embedding and LM head with the vocabulary split over the tensor-parallel ranks.

Rank r holds vocabulary rows [r * per_rank, (r + 1) * per_rank), per_rank = ceil(vocab / tp); the
last rank's tail past the vocabulary is zero padding. The embedding looks up the tokens it holds,
zeros the others and all-reduces; the LM head computes its rows' logits and TP rank 0 gathers
them. A tied LM head shares the embedding's parameter (same rows, same shard).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from backend.distributed import ParallelState, get_parallel_state, tp_all_reduce, tp_gather
from backend.models.linear import LinearBase


def vocab_shard(vocab_size: int, state: ParallelState) -> tuple[int, int, int]:
    """(first row, rows that exist, rows incl. padding) of this rank's part of the vocabulary."""
    per_rank = -(-vocab_size // state.tp_size)
    start = min(state.tp_rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


def load_vocab_rows(param: nn.Parameter, loaded: torch.Tensor, start: int, rows: int) -> None:
    if loaded.shape[1:] != param.shape[1:]:
        raise ValueError(f"shape {tuple(loaded.shape)} where [vocab, {param.shape[1]}] was expected")
    param.data[:rows].copy_(loaded.narrow(0, start, rows))
    param.data[rows:].zero_()


class VocabParallelEmbedding(nn.Module):
    """weight: [per_rank, embedding_dim] of this rank; forward: ids [num_tokens] -> [num_tokens, dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.parallel = get_parallel_state()
        self.num_embeddings = num_embeddings
        self.start, self.rows, per_rank = vocab_shard(num_embeddings, self.parallel)
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out, self.parallel)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_vocab_rows(param, loaded, self.start, self.rows)


class ParallelLMHead(LinearBase):
    """hidden [num_rows, hidden] -> logits [num_rows, vocab] on TP rank 0, None on the other ranks.

    Its matmul is ``linear_method.apply`` like every linear layer's.
    """

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        state = get_parallel_state()
        self.vocab_size = vocab_size
        self.start, self.rows, per_rank = vocab_shard(vocab_size, state)
        super().__init__(hidden_size, per_rank, bias)

    def tie_to(self, embedding: VocabParallelEmbedding) -> "ParallelLMHead":
        """Use the embedding's weight (tied word embeddings): one parameter, loaded once."""
        self.weight = embedding.weight
        self.weight_is_shared = True  # a linear method must not free it
        return self

    def forward(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        logits = self.linear_method.apply(self, hidden, self.bias)  # [num_rows, per_rank]
        if self.parallel.tp_size == 1:
            return logits
        logits = tp_gather(logits, self.parallel)
        return None if logits is None else logits[:, :self.vocab_size]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_vocab_rows(param, loaded, self.start, self.rows)
