"""Logprobs of chosen and prompt tokens under a distribution: per position, the token's logprob
and rank, then the top-k (or the requested token IDs)."""

from __future__ import annotations

from typing import Optional

import torch

from backend.types.outputs import Logprob, PositionLogprobs


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: list[int], num_top: int
) -> list[PositionLogprobs]:
    """Logprobs of prompt tokens under the raw model distribution.

    logits: [num_positions, vocab], row i predicting ``target_token_ids[i]``.
    Returns one dict per position: the target token first, then the top ``num_top`` (-1: every token).
    """
    if logits.dim() != 2 or logits.shape[0] != len(target_token_ids):
        raise ValueError(
            f"logits must be [num_positions={len(target_token_ids)}, vocab], got shape {tuple(logits.shape)}."
        )
    if num_top < -1:
        raise ValueError(f"num_top must be -1 (every token) or non-negative, got {num_top}.")
    if not target_token_ids:
        return []
    logprobs = logits.float().log_softmax(dim=-1)  # [num_positions, vocab]
    targets = torch.tensor(target_token_ids, device=logits.device)
    return position_logprobs(logprobs, targets, [num_top] * len(target_token_ids))


def position_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_tops: list[int],
    token_ids: Optional[list[Optional[list[int]]]] = None,
) -> list[PositionLogprobs]:
    """logprobs [n, vocab], chosen [n] → per row {chosen: Logprob, then top-k by rank}; a k of -1
    (vLLM's "the whole vocabulary") lists every token.

    The chosen token's rank is 1 + the number of tokens strictly more likely; the
    top-k get ranks 1..k. A chosen token that is also in the top-k appears once.
    Where ``token_ids[i]`` is given, row i lists those tokens (in that order,
    each with its rank) instead of a top-k.
    """
    vocab_size = logprobs.shape[1]
    num_tops = [vocab_size if k < 0 else min(k, vocab_size) for k in num_tops]
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1))  # [n, 1]
    chosen_ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1  # [n]
    max_top = max(num_tops)
    if max_top > 0:
        top = logprobs.topk(max_top, dim=-1)  # [n, max_top] each
        top_values, top_ids = top.values.tolist(), top.indices.tolist()

    result: list[PositionLogprobs] = []
    for i, (token_id, logprob, rank) in enumerate(
        zip(chosen.tolist(), chosen_logprobs.squeeze(1).tolist(), chosen_ranks.tolist())
    ):
        position: PositionLogprobs = {token_id: Logprob(logprob, rank)}
        wanted = token_ids[i] if token_ids is not None else None
        if wanted is not None:
            ids = torch.tensor(wanted, device=logprobs.device)
            values = logprobs[i].index_select(0, ids)  # [m]
            ranks = (logprobs[i].unsqueeze(0) > values.unsqueeze(1)).sum(dim=-1) + 1  # [m]
            for wanted_id, value, wanted_rank in zip(wanted, values.tolist(), ranks.tolist()):
                position.setdefault(wanted_id, Logprob(value, wanted_rank))
        else:
            for top_rank in range(num_tops[i]):
                top_id = top_ids[i][top_rank]
                if top_id not in position:
                    position[top_id] = Logprob(top_values[i][top_rank], top_rank + 1)
        result.append(position)
    return result
