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


