"""Which backends the router will use (frontend/router.py): health checks, refused calls and
retries, backends serving another model or tokenizer, and backends refusing our credentials.

The backends are fakes (tests/router_fakes.py).
"""

from __future__ import annotations

import logging

import pytest
from router_fakes import FakeBackend, make_router, refresh, run, send, serving

import frontend.router
from frontend.grpc_client import BackendCredentialsError, BackendOverloadedError, BackendUnavailableError
from frontend.router import Target


def test_an_unhealthy_backend_is_skipped_and_taken_back_when_it_serves_again():
    async def scenario():
        router, fakes = make_router()
        await router.refresh()
        prompt = [5] * 20
        favourite = router.choose(prompt)[0].address
        fakes[favourite].healthy = False
        await router.refresh()
        assert router.choose(prompt)[0].address == favourite  # one missed check is no verdict
        await router.refresh()
        assert await router.health()  # the others still serve
        await send(router, prompt)
        during = serving(fakes, prompt)
        fakes[favourite].healthy = True
        await router.refresh()
        back = router.choose(prompt)[0].address
        await router.close()
        return favourite, during, back

    favourite, during, back = run(scenario())
    assert favourite not in during and len(during) == 1
    assert back == favourite


def test_a_refused_call_goes_to_the_next_backend_and_marks_the_first_down():
    async def scenario():
        router, fakes = make_router()
        await router.refresh()
        prompt = [9] * 20
        favourite = router.choose(prompt)[0].address
        fakes[favourite].fail_before_output = BackendUnavailableError("connection refused")
        tokens = await send(router, prompt)
        chosen_after = router.choose(prompt)[0].address
        await router.close()
        return favourite, tokens, serving(fakes, prompt), chosen_after

    favourite, tokens, served_by, chosen_after = run(scenario())
    assert tokens == [1, 2] and len(served_by) == 1 and favourite not in served_by
    assert chosen_after != favourite  # skipped at once, without waiting for a health check


def test_overloaded_everywhere_is_the_last_backends_error_and_mid_stream_errors_are_not_retried():
    async def scenario():
        router, fakes = make_router(("a:1", "b:1"))
        await router.refresh()
        for fake in fakes.values():
            fake.fail_before_output = BackendOverloadedError("queue full")
        with pytest.raises(BackendOverloadedError):
            await send(router, [1])
        assert all(b.usable for b in router.backends.values())  # overloaded is not down
        for fake in fakes.values():
            fake.fail_before_output = None
            fake.fail_after_output = BackendUnavailableError("died mid-stream")
        with pytest.raises(BackendUnavailableError):
            await send(router, [2])
        served = sum(len(f.served) for f in fakes.values())
        await router.close()
        return served

    assert run(scenario()) == 1  # the mid-stream failure was not sent again


def test_no_healthy_backend_is_unavailable_and_unhealthy():
    async def scenario():
        router, fakes = make_router(("a:1",))
        fakes_health = await router.health()
        await router.refresh()
        fakes["a:1"].healthy = False
        await refresh(router)
        with pytest.raises(BackendUnavailableError, match="connection refused"):
            await send(router, [1])  # tried anyway (it served before), and it refused
        healthy = await router.health()
        await router.close()
        return fakes_health, healthy

    assert run(scenario()) == (False, False)


def test_when_every_check_misses_backends_that_served_before_are_still_tried():
    async def scenario():
        router, fakes = make_router(("a:1", "b:1"))
        await router.refresh()
        for fake in fakes.values():
            fake.healthy = False  # a busy machine: checks time out...
            fake.answers_when_unhealthy = True  # ...but requests are served
        await refresh(router)
        healthy = await router.health()
        tokens = await send(router, [4] * 10)
        await router.close()
        return healthy, tokens

    assert run(scenario()) == (False, [1, 2])


def test_a_backend_with_another_model_or_tokenizer_is_refused():
    async def scenario():
        router, fakes = make_router(("a:1",))
        await router.refresh()  # a is the reference
        router.targets.append(Target("b", 1, False))
        router.resolve_interval = 0
        await router.refresh()
        fakes["b:1"].fingerprint = "0" * 64  # b came up with another tokenizer
        fakes["b:1"].healthy = False
        await refresh(router)
        fakes["b:1"].healthy = True
        await router.refresh()
        refused = router.backends["b:1"].refused
        picks = {router.choose([i])[0].address for i in range(20)}
        await router.close()
        return refused, picks

    refused, picks = run(scenario())
    assert refused and "tokenizer" in refused and picks == {"a:1"}


def test_a_backend_refusing_our_credentials_is_skipped_reported_again_and_taken_back_once_fixed(caplog,
                                                                                                monkeypatch):
    refusal = BackendCredentialsError("The backend refused this frontend's credentials (UNAUTHENTICATED: "
                                      "wrong token): give ... --backend-auth-token")
    router, fakes = make_router(("a:1", "b:1"))
    make_fake = router.client_factory

    def refusing(address: str) -> FakeBackend:
        fake = make_fake(address)
        fake.model_error = refusal  # health is open; the first call that needs the token fails
        return fake

    router.client_factory = refusing

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]

    async def scenario() -> None:
        with caplog.at_level(logging.INFO, "frontend.router"):
            await router.refresh()
            assert not await router.health()
            problem = router.credentials_problem()
            assert problem is not None and "a:1" in problem and "b:1" in problem and "UNAUTHENTICATED" in problem
            assert len(errors()) == 2 and all("--backend-auth-token" in line for line in errors())
            await router.refresh()
            assert len(errors()) == 2  # not every second...
            monkeypatch.setattr(frontend.router, "CREDENTIALS_LOG_INTERVAL_S", 0.0)
            await router.refresh()
            assert len(errors()) == 4  # ...but again while it lasts
            # One backend still starting up (unreachable): it may yet serve, so no verdict.
            fakes["b:1"].model_error, fakes["b:1"].healthy = None, False
            await refresh(router)
            assert router.credentials_problem() is None and not await router.health()
            fakes["b:1"].healthy = True  # up, with the right token
            await router.refresh()
            assert await router.health() and router.credentials_problem() is None
            assert await send(router, [1, 2, 3]) == [1, 2]
            assert serving(fakes, [1, 2, 3]) == ["b:1"]  # never the refusing one
            fakes["a:1"].model_error = None  # fixed (its token changed back)
            await router.refresh()
            assert router.backends["a:1"].usable and router.backends["a:1"].credentials_refused is None

    run(scenario())
