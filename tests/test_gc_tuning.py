"""tune_gc_for_serving (backend.types.startup_heap): the heap alive
at start-up is frozen, and young collections are rarer."""

from __future__ import annotations

import gc

from backend.types.startup_heap import YOUNG_THRESHOLD, tune_gc_for_serving


def test_the_live_heap_is_frozen_and_the_young_threshold_raised():
    thresholds = gc.get_threshold()
    try:
        before = gc.get_freeze_count()
        alive = [[i] for i in range(1000)]  # containers: objects the collector tracks
        tune_gc_for_serving()
        assert gc.get_freeze_count() >= before + len(alive)
        assert gc.get_threshold() == (YOUNG_THRESHOLD, thresholds[1], thresholds[2])
    finally:  # this test process goes on collecting as before
        gc.unfreeze()
        gc.set_threshold(*thresholds)
