"""The frontend's garbage-collector settings while it serves (torch-free).

Every streamed token allocates short-lived objects (generator frames, dicts, strings), so with
CPython's defaults the cyclic collector runs a young collection every 700 net allocations, and
now and then an old one that walks the whole heap; in a frontend that heap is mostly what
start-up left (transformers, the tokenizer, FastAPI's routes, the metrics), none of which ever
becomes garbage. So start-up's heap is frozen (``backend.types.startup_heap``, as the backend
does) and young collections are rarer: reference counting frees almost everything a request
makes, so collecting rarely loses little memory and saves CPU (bench/README.md: the app's CPU
per streamed token).
"""

from __future__ import annotations

import gc

from backend.types.startup_heap import freeze_startup_heap

YOUNG_THRESHOLD = 10_000  # net allocations between young collections (CPython's default: 700)


def tune_gc_for_serving() -> None:
    """Freeze every object alive now and make young collections rarer (the older generations
    keep their thresholds). Call it once, when the app is built and before it serves."""
    freeze_startup_heap()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
