"""The engine's fast path for the common step result: one decode token of a plain sequence."""

from __future__ import annotations

from typing import Optional

from backend.core.block_manager import BlockManager
from backend.core.request import Request
from backend.engine.stop_conditions import check_stop
from backend.messages.scheduler_output import ScheduledRequest
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


def apply_decode_tokens(scheduled: list[ScheduledRequest], start: int, requests: dict[str, Request],
                        sampled: dict[str, list[int]], logprobs: Optional[dict], preempted_since: Optional[int],
                        failed: dict[str, str], eos_token_ids, max_model_len: int,
                        block_manager: BlockManager, outputs: list[EngineOutput]
                        ) -> tuple[int, Optional[Request], Optional[Exception]]:
    """Apply ``scheduled[start:]``'s results in order, while each is a sequence that decoded one
    token past its first output and was neither failed nor preempted since it was scheduled
    (``preempted_since``: the scheduler's preemption count then, None if no preemption came
    since): append the token, cache its full blocks, append its output to ``outputs``. The caller
    guarantees the step has no grammar, beams, prompt logprobs or pooling.

    One loop over the batch, without a call per sequence. Returns (i, None, None): ``scheduled[i]``
    needs the general rule (or i is the end); (i + 1, request, None): the token ended
    ``scheduled[i]``'s request (its output, last in ``outputs``, says why; the caller finishes it);
    (i + 1, request, error): applying its token raised ``error`` (no output; the caller fails it).
    """
    requests_get = requests.get
    caching = block_manager.enable_prefix_caching
    hashed_get, block_size = block_manager.req_num_hashed_blocks.get, block_manager.block_size
    append_output = outputs.append
    for i in range(start, len(scheduled)):
        s = scheduled[i]
        request_id = s.request_id
        request = requests_get(request_id)
        if (request is None or not s.needs_sample or len(s.token_ids) != 1
                or (failed and request_id in failed)):
            return i, None, None
        output_ids = request.output_token_ids
        if (not output_ids or s.start_pos < len(request.prompt_token_ids)
                or (preempted_since is not None and request.preempted_at > preempted_since)):
            return i, None, None
        try:
            new_tokens = sampled[request_id]  # the runner's list, shared: no one changes an output's lists
            token_id = new_tokens[0]
            if len(new_tokens) != 1:
                new_tokens = [token_id]
            output_ids.append(token_id)
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
            computed = request.num_computed_tokens = request.num_computed_tokens + 1
            request.num_placeholders -= 1
            # BlockManager.cache_full_blocks, called only when a block filled since the last call.
            if caching:
                if computed > len(known):
                    computed = len(known)
                if computed >= (hashed_get(request_id, 0) + 1) * block_size:
                    block_manager.cache_full_blocks(request, computed)
            new_logprobs = None
            if logprobs:
                new_logprobs = logprobs.get(request_id)
                if new_logprobs is not None:
                    new_logprobs = new_logprobs[:1]
            cached = request.num_cached_tokens
            append_output(EngineOutput(request.parent_id, request.index, new_tokens, new_logprobs, reason,
                                       request.stop_reason, len(request.prompt_token_ids),
                                       cached if cached > 0 else 0))
        except Exception as error:  # noqa: BLE001 -- this sequence's alone: the caller fails it
            return i + 1, request, error
        if reason is not None:
            return i + 1, request, None
    return len(scheduled), None, None
