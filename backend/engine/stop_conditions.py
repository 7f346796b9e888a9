"""When a sequence stops, checked after each token it keeps."""

from __future__ import annotations

from typing import Optional

from backend.core.request import Request
from backend.types.outputs import FinishReason


def check_stop(request: Request, token_id: int, eos_token_ids, max_model_len: int) -> Optional[FinishReason]:
    """STOP on EOS (unless ignore_eos) or a stop token ID (recorded as ``request.stop_reason``),
    from min_tokens on; LENGTH at max_tokens or max_model_len; else None. ``token_id`` is the
    sequence's newest output token, already appended."""
    params = request.sampling_params
    num_outputs = len(request.output_token_ids)
    if num_outputs >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return FinishReason.STOP
        if params.stop_token_ids and token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return FinishReason.STOP
    if params.max_tokens is not None and num_outputs >= params.max_tokens:
        return FinishReason.LENGTH
    if len(request.all_token_ids) >= max_model_len:
        return FinishReason.LENGTH
    return None
