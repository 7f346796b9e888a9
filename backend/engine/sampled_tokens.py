"""The engine's general rule for a sequence's sampled tokens in a step (drafts, grammar, the first
token, prompt logprobs, pooling); ``decode_step.py`` is its fast path for the common case."""

from __future__ import annotations

from typing import Callable, Optional

from backend.core.block_manager import BlockManager
from backend.core.request import Request
from backend.engine.stop_conditions import check_stop
from backend.messages.scheduler_output import ScheduledRequest
from backend.types.outputs import EngineOutput, FinishReason


def apply_sampled_tokens(request: Request, s: ScheduledRequest, runner_out, now: float, stale: bool,
                         eos_token_ids, max_model_len: int, block_manager: BlockManager,
                         advance_grammar: Optional[Callable[[Request, int], Optional[FinishReason]]]
                         ) -> tuple[EngineOutput, int]:
    """Append the tokens ``runner_out`` sampled for ``request`` (scheduled as ``s``) up to the
    first that stops it, mark the scheduled tokens computed (less the rejected drafts), cache its
    full blocks (unless ``stale``: preempted since it was scheduled) and return its output and
    the number of drafts accepted. ``advance_grammar`` (constrained batches): feeds each kept
    token to the sequence's grammar, a finish reason once it is complete or violated. A finish
    reason in the output is not acted on here: the caller finishes the sequence."""
    first = not request.output_token_ids
    sampled = runner_out.sampled_token_ids[s.request_id]
    new_tokens, reason = [], None
    output_ids, all_ids = request.output_token_ids, request.all_token_ids
    for token_id in sampled:
        output_ids.append(token_id)
        all_ids.append(token_id)
        new_tokens.append(token_id)
        reason = check_stop(request, token_id, eos_token_ids, max_model_len)
        if advance_grammar is not None and reason is None:  # every kept token advances the grammar
            reason = advance_grammar(request, token_id)
        if reason is not None:
            break
    # The KV cache now holds every scheduled token but the rejected drafts.
    rejected = s.num_draft_tokens - (len(sampled) - 1)
    request.complete_step(len(s.token_ids), rejected, True, stale)
    if not stale:
        block_manager.cache_full_blocks(request, min(request.num_computed_tokens, len(all_ids)))
    if first:
        request.first_token_time = now
    logprobs = runner_out.logprobs.get(s.request_id)
    output = EngineOutput(
        request_id=request.parent_id, index=request.index, new_token_ids=new_tokens,
        new_logprobs=logprobs[:len(new_tokens)] if logprobs is not None else None,
        finish_reason=reason, stop_reason=request.stop_reason,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_cached_tokens=max(request.num_cached_tokens, 0),
        pooled=runner_out.pooled.get(s.request_id) if runner_out.pooled else None,
        scheduled_time=request.scheduled_time if first else None,
        # A one-token prompt has no logprobs computed: its list is [None], as any prompt's starts.
        prompt_logprobs=(request.prompt_logprobs or [None]) if first and request.wants_prompt_logprobs
        else None)
    return output, s.num_draft_tokens - rejected
