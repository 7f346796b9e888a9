"""Keep the garbage collector off the objects a process builds at start-up, and rare while it serves.

A serving process allocates on every step (scheduled requests, outputs, lists), so CPython's
collector runs often, and each full collection walks every tracked object in the process: the
modules, the model, the tokenizer, the block manager. At 256 sequences x 1k context on the simulated
device (bench/host_overhead.py) that cost 3.5 ms a step on average, in pauses of 100 ms and more,
more than a GPU's whole decode step. Freezing the start-up heap moves those objects to a permanent
generation the collector skips; they are still freed by reference counting when dropped.

Young collections: a decode step of 256 sequences makes ~1,000 containers that live until the
step ends (its scheduled requests, token lists, outputs), more than CPython's default of 700 net
allocations between young collections, so one ran almost every step (~0.1 ms at 256 x 1k, on an
engine step of ~1.2 ms) and found them all alive. With a threshold above one step's allocations
reference counting frees them first, and a young collection is rare. Used by both processes:
the backend (engine and workers) and the frontend (``frontend.server``).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000  # net allocations between young collections (CPython's default: 700)


def freeze_startup_heap() -> int:
    """Collect once, then freeze everything alive. Call once, when start-up is done, in a process
    that serves one engine for its lifetime (a cycle among frozen objects is never collected).
    Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def tune_gc_for_serving() -> None:
    """Freeze every object alive now and make young collections rarer (the older generations
    keep their thresholds). Call it once, when start-up is done and before serving."""
    freeze_startup_heap()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
