"""Verifying speculative drafts in the runner (the proposing side is ``backend.core.spec_decode``)."""

from __future__ import annotations


def accept_drafts(drafts: list[int], sampled: list[int]) -> list[int]:
    """sampled[i]: the model's token at draft position i (len(drafts) + 1 of them). Returns the
    tokens the sequence gains: the drafts the model agreed with, then its own next token."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return sampled[:accepted + 1]
