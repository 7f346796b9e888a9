"""A step handed to the executor whose results the engine has not processed yet.

With async scheduling (``EngineConfig.async_scheduling``) the engine schedules and launches step
N+1 before it processes step N's tokens, so the host work of each step (scheduling, stop checks,
grammar advancement, output building) runs while the device computes the other. The pieces that
let it stay exact:

- step N+1 computes each sequence's token from step N as a placeholder, which the model runner
  fills from its own sampled tokens (``backend.messages.scheduler_output.PLACEHOLDER_TOKEN_ID``);
- a sequence that stops at step N has its step N+1 token dropped, never emitted;
- a structured-output sequence's allowed tokens for step N+1 depend on its token from step N, so
  step N+1's grammar is a ``LateGrammar`` (backend/messages/late_grammar.py) the engine resolves once step N is processed; the
  runner runs the forward meanwhile and waits for it only to sample.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

from backend.messages.late_grammar import LateGrammar
from backend.messages.scheduler_output import SchedulerOutput


@dataclass
class InFlightStep:
    sched: SchedulerOutput
    # The runner's output once done (async scheduling); None: the step runs synchronously.
    future: Optional[Future] = None
    # The scheduler's num_preemptions_total when launched (async scheduling): a sequence preempted
    # since (its ``preempted_at`` is larger) keeps only the token (its KV cache went with its blocks).
    preemptions: Optional[int] = None
    # Sequence ID -> why it failed (drafting, its grammar mask); the engine ends it with the step.
    failed: dict[str, str] = field(default_factory=dict)
    grammar: Optional[LateGrammar] = None
