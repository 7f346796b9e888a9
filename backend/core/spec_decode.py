"""Speculative decoding by n-gram prompt lookup: draft tokens copied from the sequence itself.

For a sequence ending in tokens ``... a b c``, find the latest earlier place where the same
n-gram ``a b c`` occurred (trying ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens)
and propose the tokens that followed it there. The model then scores the last token and the
drafts in one step; the runner keeps the drafts up to the first one the model would not have
picked itself, plus the model's own next token (see ``accept_drafts``), so outputs are those of
plain decoding: exactly for greedy requests, in distribution for sampled ones (a draft is a
point mass, so "sample the target, keep the draft if they agree" is exact rejection sampling).

It pays where outputs repeat their input: summaries, edits, code, extraction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from backend.core.request import Request
from backend.types.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens that followed the latest earlier match of the longest
        suffix n-gram of token_ids; [] when there is none."""
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n:]
            first = suffix[0]
            # Latest start i < length - n with token_ids[i:i + n] == suffix.
            i = length - n - 1
            while i >= 0:
                if token_ids[i] == first and token_ids[i:i + n] == suffix:
                    return token_ids[i + n:i + n + limit]
                i -= 1
        return []


def propose_drafts(running: list[Request], proposer: NgramProposer, config: SpeculativeConfig,
                   max_model_len: int, gets_drafts: Callable[[Request], bool]) -> Iterable[tuple[Request, Exception]]:
    """Give each decoding sequence in ``running`` (one for which ``gets_drafts`` holds) its drafts
    for this step, within its room (max_model_len, max_tokens); yields each sequence whose
    drafting raised, with the error (it gets no drafts)."""
    if config.disable_by_batch_size is not None and len(running) > config.disable_by_batch_size:
        return
    for request in running:
        if request.num_computed_tokens != request.num_tokens - 1 or not gets_drafts(request):
            continue  # still prefilling, or not to be drafted for
        params = request.sampling_params
        room = max_model_len - request.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        try:
            request.draft_token_ids = proposer.propose(request.all_token_ids, room)
        except Exception as error:  # noqa: BLE001 -- no drafts; the caller ends the sequence
            yield request, error
