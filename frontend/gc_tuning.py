"""The frontend's garbage-collector settings while it serves (torch-free).

Every streamed token allocates short-lived objects (generator frames, dicts, strings), so with
CPython's defaults the cyclic collector runs a young collection every 700 net allocations, and
now and then an old one that walks the whole heap; in a frontend that heap is mostly what
start-up left (transformers, the tokenizer, FastAPI's routes, the metrics), none of which ever
becomes garbage. So start-up's heap is frozen and young collections are rarer, as in the backend
(``backend.types.startup_heap``): reference counting frees almost everything a request makes, so
collecting rarely loses little memory and saves CPU (bench/README.md: the app's CPU per streamed
token).
"""

from __future__ import annotations

from backend.types.startup_heap import YOUNG_THRESHOLD, tune_gc_for_serving

__all__ = ["YOUNG_THRESHOLD", "tune_gc_for_serving"]
