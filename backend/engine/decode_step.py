"""The engine's fast path for the common step result: one decode token of a plain sequence."""

from __future__ import annotations

from typing import Optional

from backend.core.block_manager import BlockManager
from backend.core.request import Request
from backend.engine.stop_conditions import check_stop
from backend.types.outputs import EngineOutput


def apply_decode_token(request: Request, token_id: int, logprobs: Optional[list], eos_token_ids,
                       max_model_len: int, block_manager: BlockManager) -> EngineOutput:
    """Append ``token_id`` to a sequence that decoded one token past its first output (no drafts,
    grammar, beams, prompt logprobs or pooling; not preempted since it was scheduled: the caller
    checks), cache its full blocks and return its output. A finish reason in the output is not
    acted on here: the caller finishes the sequence."""
    request.output_token_ids.append(token_id)
    request.all_token_ids.append(token_id)
    if request.draft_token_ids:
        request.draft_token_ids = []
    reason = check_stop(request, token_id, eos_token_ids, max_model_len)
    request.complete_step(1, 0, True)
    block_manager.cache_full_blocks(request, min(request.num_computed_tokens, len(request.all_token_ids)))
    return EngineOutput(request.parent_id, request.index, [token_id],
                        logprobs[:1] if logprobs is not None else None, reason,
                        request.stop_reason, len(request.prompt_token_ids),
                        max(request.num_cached_tokens, 0))
