"""The frontend's garbage-collector settings while it serves (torch-free).

Every streamed token allocates short-lived objects (generator frames, dicts, strings), so with
CPython's defaults the cyclic collector runs a young collection every 700 net allocations, and
now and then an old one that walks the whole heap; in a frontend that heap is mostly what
start-up left (transformers, the tokenizer, FastAPI's routes, the metrics), none of which ever
becomes garbage. Reference counting frees almost everything a request makes, so collecting
rarely loses little memory and saves CPU (bench/README.md: the app's CPU per streamed token).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000  # net allocations between young collections (CPython's default: 700)


def freeze_startup_heap() -> None:
    """Move every object alive now into the permanent generation (``gc.freeze``), so no later
    collection walks it, and make young collections rarer. Call it once, when the app is built
    and before it serves; the older generations keep their thresholds."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
