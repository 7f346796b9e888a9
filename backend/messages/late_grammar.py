"""The grammar masks of a step launched before they could be filled (async scheduling).

A structured-output sequence's allowed tokens at step N+1 depend on its token from step N, which
the engine processes while step N+1 already runs; the runner runs the forward meanwhile and waits
for the masks only to sample.
"""

from __future__ import annotations

from concurrent.futures import Future


class LateGrammar(Future):
    """``SchedulerOutput.grammar`` of a step launched before its masks could be filled: its
    result is the step's ``GrammarBitmask`` (or None), set by the engine."""


def resolve_grammar(grammar):
    """The grammar mask a runner samples with: waits for a ``LateGrammar``."""
    return grammar.result() if isinstance(grammar, LateGrammar) else grammar
