"""Streaming every N tokens instead of every token (``--stream-interval``, as SGLang and vLLM have).

Each delta a served request streams costs a gRPC entry, a frontend wake-up, an SSE event and a
socket write, whatever it carries. With ``stream_interval`` N > 1, a sequence's deltas are held
and merged until they carry N tokens: its first token still goes out at once (time to first token
is unchanged), and its last delta goes out with its end, whatever it holds. The tokens, logprobs
and ends are exactly the uncoalesced stream's; only the cuts between deltas move.
"""

from __future__ import annotations

from typing import Optional

from backend.types.config import MAX_STREAM_INTERVAL
from backend.types.outputs import EngineOutput


def merge_deltas(first: EngineOutput, later: EngineOutput) -> EngineOutput:
    """One delta saying what ``first`` then ``later`` (the same sequence's, in order) said."""
    logprobs = first.new_logprobs
    if later.new_logprobs is not None:
        logprobs = later.new_logprobs if logprobs is None else logprobs + later.new_logprobs
    return EngineOutput(
        request_id=later.request_id, index=later.index, new_token_ids=first.new_token_ids + later.new_token_ids,
        new_logprobs=logprobs, finish_reason=later.finish_reason, stop_reason=later.stop_reason,
        num_prompt_tokens=later.num_prompt_tokens, num_cached_tokens=later.num_cached_tokens,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else later.prompt_logprobs,
        error=later.error, pooled=later.pooled,
        scheduled_time=first.scheduled_time if first.scheduled_time is not None else later.scheduled_time)


class DeltaCoalescer:
    """One request's deltas, regrouped to ``interval`` tokens each (per sequence ``index``).

    ``push`` takes the engine's deltas in order and returns the one to send now, or None while it
    holds it. A delta goes out at once when it is its sequence's first with tokens, ends its
    sequence, carries an error, or brings the held tokens to ``interval``. Ended sequences hold
    nothing, so a request's last push leaves nothing behind.
    """

    __slots__ = ("interval", "_held", "_started")

    def __init__(self, interval: int) -> None:
        if not 1 <= interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"stream interval must be between 1 and {MAX_STREAM_INTERVAL}; got {interval}")
        self.interval = interval
        self._held: dict[int, EngineOutput] = {}  # sequence index -> its deltas not sent yet, merged
        self._started: set[int] = set()  # sequences whose first token was sent

    def push(self, output: EngineOutput) -> Optional[EngineOutput]:
        index = output.index
        held = self._held.pop(index, None)
        if held is not None:
            output = merge_deltas(held, output)
        if output.finish_reason is not None or output.error is not None:
            self._started.discard(index)
            return output
        if not output.new_token_ids:
            return output  # nothing to hold back (a held delta has tokens, so none was merged in)
        if index not in self._started:
            self._started.add(index)
            return output
        if len(output.new_token_ids) >= self.interval:
            return output
        self._held[index] = output
        return None
