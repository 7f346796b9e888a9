"""The stored responses' store (``backend.types.bounded_store``): bounded by count, bytes and age,
and the backend's bounded by its --max-stored-response* flags."""

from __future__ import annotations

import asyncio

import pytest
from conftest import build_tokenizer

from backend.server.servicer import EngineServicer
from backend.types.bounded_store import BoundedStore
from backend.types.limits import Limits
from protos.tandem.engine.v1 import engine_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_store_is_bounded_by_count_and_bytes_least_recently_used_first():
    store = BoundedStore(max_entries=3, max_bytes=100)
    for name in "abc":
        assert store.put(name, name, 10)
    assert store.get("a") == "a"  # a is now the most recently used
    store.put("d", "d", 10)  # the count bound: b, the least recently used, goes
    assert store.get("b") is None and len(store) == 3 and store.num_bytes == 30
    store.put("e", "e", 85)  # 30 + 85 > 100: c then a go (least recent first), d fits beside e
    assert store.get("c") is None and store.get("a") is None and store.num_bytes == 95
    assert store.get("d") == "d" and store.get("e") == "e"
    assert not store.put("huge", "x", 101) and store.get("huge") is None and store.num_bytes == 95
    store.put("e", "e2", 5)  # replacing counts the new size only
    assert store.num_bytes == 15 and store.delete("e") and not store.delete("e") and store.num_bytes == 10


def test_an_entry_is_gone_its_max_age_after_it_was_put_however_recently_used():
    clock = Clock()
    store = BoundedStore(max_entries=10, max_bytes=100, max_age_s=60, clock=clock)
    store.put("a", "a", 10)
    clock.now += 30
    store.put("b", "b", 20)
    clock.now += 29
    assert store.get("a") == "a"  # 59 s old: kept, and now the most recently used
    clock.now += 1
    assert store.get("a") is None  # 60 s after its put: gone, its bytes freed
    assert len(store) == 1 and store.num_bytes == 20 and store.get("b") == "b"
    store.put("b", "b2", 5)  # replacing restarts its age
    clock.now += 59
    assert store.get("b") == "b2" and not store.delete("a")
    clock.now += 1
    assert len(store) == 0 and store.num_bytes == 0
    with pytest.raises(ValueError):
        BoundedStore(1, 1, max_age_s=0)


def test_the_backend_keeps_stored_responses_for_its_max_age(tmp_path):
    build_tokenizer(tmp_path)
    limits = Limits(max_stored_responses=2, max_stored_response_age_s=60)
    servicer = EngineServicer(None, str(tmp_path), limits=limits)  # the stored-response RPCs need no engine
    clock = Clock()
    servicer._stored_responses.clock = clock

    async def calls():
        for name in ("a", "b", "c"):  # the count bound: a goes
            assert (await servicer.PutStoredResponse(
                engine_pb2.PutStoredResponseRequest(response_id=name, payload=name.encode()), None)).stored
            clock.now += 20
        found = [(await servicer.GetStoredResponse(engine_pb2.GetStoredResponseRequest(response_id=name), None)).found
                 for name in ("a", "b", "c")]
        clock.now += 21  # b: 61 s old, c: 41 s
        later = [(await servicer.GetStoredResponse(engine_pb2.GetStoredResponseRequest(response_id=name), None)).found
                 for name in ("b", "c")]
        return found, later

    assert asyncio.run(calls()) == ([False, True, True], [False, True])
