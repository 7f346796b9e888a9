"""Which backend the router picks (frontend/router.py): prefix affinity (rendezvous hashing) and
its fallback to the least loaded, and the other policies.

The backends are fakes (tests/router_fakes.py).
"""

from __future__ import annotations

from router_fakes import make_router, refresh, run, send

from backend.types.sampling_params import SamplingParams
from frontend.router import prefix_key


def test_a_prefix_always_lands_on_one_backend_and_distinct_prefixes_spread():
    async def scenario():
        router, fakes = make_router(prefix_tokens=8)
        await router.refresh()
        shared = list(range(100, 120))
        for i in range(10):  # same first 8 tokens, different tails
            await send(router, shared + [i])
        owners = {address for address, fake in fakes.items() for p in fake.served if p[:20] == shared}
        distinct = [[i] * 12 for i in range(30)]
        for prompt in distinct:
            await send(router, prompt)
        counts = sorted(sum(p in fake.served for p in distinct) for fake in fakes.values())
        await router.close()
        return owners, counts

    owners, counts = run(scenario())
    assert len(owners) == 1
    assert sum(counts) == 30 and counts[0] >= 4  # every backend got a fair share of new prefixes


def test_affinity_agrees_across_routers_and_survives_losing_another_backend():
    """Rendezvous hashing: two frontends pick alike; a backend going away moves only its own keys."""
    async def scenario():
        first, first_fakes = make_router()
        second, _ = make_router()
        await first.refresh()
        await second.refresh()
        prompts = [[i, i + 1, i + 2] for i in range(40)]
        picks = [first.choose(p)[0].address for p in prompts]
        assert picks == [second.choose(p)[0].address for p in prompts]
        lost = picks[0]
        first_fakes[lost].healthy = False
        await refresh(first)
        after = [first.choose(p)[0].address for p in prompts]
        await first.close()
        await second.close()
        return picks, after, lost

    picks, after, lost = run(scenario())
    assert lost not in after
    assert all(a == b for a, b in zip(picks, after) if a != lost)


def test_the_cache_salt_is_part_of_the_key():
    assert prefix_key([1, 2, 3], 8) != prefix_key([1, 2, 3], 8, salt="tenant")
    assert prefix_key([1, 2, 3, 4], 3) == prefix_key([1, 2, 3, 5], 3)


def test_an_overloaded_favourite_gives_way_to_the_least_loaded():
    async def scenario():
        router, fakes = make_router(balance_abs=4, balance_rel=1.5)
        await router.refresh()
        prompt = [7] * 10
        favourite = router.choose(prompt)[0].address
        fakes[favourite].load = 4  # not more than 4 above the others: stays
        await router.refresh()
        stays = router.choose(prompt)
        fakes[favourite].load = 20
        await router.refresh()
        moved = router.choose(prompt)
        await router.close()
        return favourite, stays, moved

    favourite, (stays, stay_reason), (moved, move_reason) = run(scenario())
    assert (stays.address, stay_reason) == (favourite, "prefix")
    assert moved.address != favourite and move_reason == "load"


def test_requests_in_flight_count_as_load_before_the_next_poll():
    async def scenario():
        router, fakes = make_router(("a:1", "b:1"), policy="least-loaded")
        await router.refresh()
        streams = [router.generate(f"r{i}", [i], SamplingParams()) for i in range(4)]
        for stream in streams:
            await anext(stream)  # each holds its backend until closed
        loads = sorted(b.load for b in router.backends.values())
        for stream in streams:
            await stream.aclose()
        await router.close()
        return loads

    assert run(scenario()) == [2, 2]


def test_round_robin_alternates():
    async def scenario():
        router, _ = make_router(("a:1", "b:1"), policy="round-robin")
        await router.refresh()
        picks = [router.choose([1])[0].address for _ in range(4)]
        await router.close()
        return picks

    assert run(scenario()) == ["a:1", "b:1", "a:1", "b:1"]
