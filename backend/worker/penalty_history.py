"""Each penalized sequence's token history as counts on the device, updated by difference.

Repetition, frequency and presence penalties need, per sequence, which tokens its prompt holds and
how often each output token occurred. Rebuilding that from the token lists every step costs
O(batch x context) Python work (at batch 256 and 1k tokens of context, most of a step). Here each
sequence that asks for a penalty gets a slot, a row of two persistent tables::

    prompt_seen    [slots, vocab] bool   its prompt's tokens, written once
    output_counts  [slots, vocab] int32  how often each output token occurred, + the new ones each step

so a step costs O(new tokens) to update and one gather of the penalized rows. A slot is freed when
its sequence finishes; the tables grow (doubling) when every slot is taken. A sequence's outputs
are counted once from its list when it first samples here, then from the runner's own sampled
tokens: on the device as they are sampled (``count``; the sampler's ``count=True``, which a greedy
step with penalties does inside its one ``penalized_argmax`` kernel) where every sequence samples
one row and none wants logprobs, else from the host (``record_all``). Output tokens are only ever
appended (a preemption keeps them; rejected drafts never join; a sequence whose tokens the engine
cuts short has ended), and the runner never reads a list the engine may be appending to meanwhile
(async scheduling).
"""

from __future__ import annotations

from typing import Sequence

import torch

from backend.worker.staged_upload import list_tensor

INITIAL_SLOTS = 16


class PenaltyHistory:
    """Token histories of the sequences that use penalties, by request ID (runner-owned)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.prompt_seen = torch.zeros(INITIAL_SLOTS, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(INITIAL_SLOTS, vocab_size, dtype=torch.int32, device=device)
        self.slot_of: dict[str, int] = {}
        self._pending_slots: list[int] = []  # tokens to count at the next update: their slots,
        self._pending_tokens: list[int] = []  # and the tokens
        self.free_slots = list(range(INITIAL_SLOTS - 1, -1, -1))

    def update(self, sequences: Sequence[tuple[str, Sequence[int], Sequence[int], int]]) -> list[int]:
        """(request ID, prompt token IDs, output token IDs, how many of them came before this
        step) of each penalized sequence this step -> their slots, with every output token
        counted. The lists are read only for a sequence seen for the first time (a sequence
        known here costs O(1), however long). Tokens outside the vocabulary (an EOS or stop ID
        the logits do not cover cannot be sampled, so they never appear) are not expected."""
        slots: list[int] = []
        for request_id, prompt, output, num_outputs in sequences:
            slot = self.slot_of.get(request_id)
            if slot is None:
                slot = self._take_slot()
                self.slot_of[request_id] = slot
                self.prompt_seen[slot].zero_()
                self.output_counts[slot].zero_()
                if prompt:
                    self.prompt_seen[slot, list_tensor(prompt, device=self.device)] = True
                self._pending_slots.extend([slot] * num_outputs)
                self._pending_tokens.extend(output[:num_outputs])
            slots.append(slot)
        self.flush()
        return slots

    def record(self, request_id: str, tokens: Sequence[int]) -> None:
        """A step's sampled tokens of a sequence (ignored unless it holds a slot): counted at the
        next ``update``, before any later step samples."""
        self.record_all({request_id: tokens})

    def record_all(self, sampled: dict[str, Sequence[int]]) -> None:
        """``record`` for each (request ID -> its tokens) of a step at once."""
        slot_of, pending_slots, pending_tokens = self.slot_of, self._pending_slots, self._pending_tokens
        for request_id, tokens in sampled.items():
            slot = slot_of.get(request_id)
            if slot is not None:
                if len(tokens) == 1:
                    pending_slots.append(slot)
                    pending_tokens.append(tokens[0])
                else:
                    pending_slots.extend([slot] * len(tokens))
                    pending_tokens.extend(tokens)

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count tokens [n] (int64, on the device) in slots [n] now, with no host round trip (a
        deferred step's tokens, which the next step's penalties must see before they reach the
        host). The runner does not ``record`` them again."""
        self.flush()
        self.output_counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def flush(self) -> None:
        """Count the recorded tokens now (``update`` does; a caller reusing its slots calls this)."""
        if self._pending_tokens:
            index = (list_tensor(self._pending_slots, device=self.device),
                     list_tensor(self._pending_tokens, device=self.device))
            self.output_counts.index_put_(index, torch.ones(len(self._pending_tokens), dtype=torch.int32,
                                                            device=self.device), accumulate=True)
            self._pending_slots, self._pending_tokens = [], []

    def release(self, request_ids) -> None:
        """Free the slots of finished sequences (unknown IDs are ignored)."""
        for request_id in request_ids:
            slot = self.slot_of.pop(request_id, None)
            if slot is not None:
                self.free_slots.append(slot)
        if self._pending_tokens:  # a freed slot's pending tokens must not land in its next sequence
            self.flush()

    def gather(self, slots: list[int], extra_tokens: Sequence[Sequence[int]],
               need_seen: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The rows of ``slots``: (prompt-or-output seen [n, vocab] bool, or None unless
        ``need_seen``; output counts [n, vocab] float32), each row also counting its
        ``extra_tokens`` (the drafts before a draft row, which are not outputs yet)."""
        index = list_tensor(slots, device=self.device)
        counts = self.output_counts.index_select(0, index).float()  # [n, vocab]
        extra_rows = [i for i, tokens in enumerate(extra_tokens) for _ in tokens]
        if extra_rows:
            flat = [t for tokens in extra_tokens for t in tokens]
            counts.index_put_((list_tensor(extra_rows, device=self.device), list_tensor(flat, device=self.device)),
                              torch.ones(len(flat), device=self.device), accumulate=True)
        seen = None
        if need_seen:
            seen = self.prompt_seen.index_select(0, index) | (counts > 0)  # [n, vocab]
        return seen, counts

    def _take_slot(self) -> int:
        if not self.free_slots:
            old = self.prompt_seen.shape[0]
            self.prompt_seen = torch.cat([self.prompt_seen, torch.zeros_like(self.prompt_seen)])
            self.output_counts = torch.cat([self.output_counts, torch.zeros_like(self.output_counts)])
            self.free_slots = list(range(2 * old - 1, old - 1, -1))
        return self.free_slots.pop()
