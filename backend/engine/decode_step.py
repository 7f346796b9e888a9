"""The engine's fast path for the common step result: one decode token of a plain sequence."""

from __future__ import annotations

from typing import Optional

from backend.core.block_manager import BlockManager
from backend.core.request import Request
from backend.engine.stop_conditions import check_stop
from backend.types.outputs import EngineOutput


def stop_filter(request: Request, eos_token_ids, max_model_len: int) -> tuple[frozenset, int]:
    """What can end ``request`` on a decode token, as a cheap test that never misses a stop:
    (token IDs that may stop it, sequence length at which it must stop). A token outside the set
    that leaves the sequence shorter than the limit does not end it; anything else goes to
    ``check_stop`` for the exact rule (min_tokens, which token, which reason)."""
    params = request.sampling_params
    tokens = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        tokens.update(eos_token_ids)
    limit = max_model_len
    if params.max_tokens is not None:  # the sequence is its prompt and its outputs
        limit = min(limit, len(request.prompt_token_ids) + params.max_tokens)
    return frozenset(tokens), limit


def apply_decode_token(request: Request, token_id: int, logprobs: Optional[list], eos_token_ids,
                       max_model_len: int, block_manager: BlockManager) -> EngineOutput:
    """Append ``token_id`` to a sequence that decoded one token past its first output (no drafts,
    grammar, beams, prompt logprobs or pooling; not preempted since it was scheduled: the caller
    checks), cache its full blocks and return its output. A finish reason in the output is not
    acted on here: the caller finishes the sequence."""
    request.output_token_ids.append(token_id)
    known = request.all_token_ids
    known.append(token_id)
    if request.draft_token_ids:
        request.draft_token_ids = []
    filter_ = request.stop_filter
    if filter_ is None:
        filter_ = request.stop_filter = stop_filter(request, eos_token_ids, max_model_len)
    reason = None
    if token_id in filter_[0] or len(known) >= filter_[1]:
        reason = check_stop(request, token_id, eos_token_ids, max_model_len)
    # Request.complete_step(1, 0, sampled=True), inline: its token left flight, its placeholder is known.
    request.num_inflight_tokens -= 1
    request.num_computed_tokens += 1
    request.num_placeholders -= 1
    block_manager.cache_full_blocks(request, min(request.num_computed_tokens, len(known)))
    return EngineOutput(request.parent_id, request.index, [token_id],
                        logprobs[:1] if logprobs is not None else None, reason,
                        request.stop_reason, len(request.prompt_token_ids),
                        max(request.num_cached_tokens, 0))
