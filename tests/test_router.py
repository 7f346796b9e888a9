"""The router (frontend/router.py) over fake backend clients: affinity, load fallback, health, retries, DNS.

Each fake stands for one backend address and records the requests it served;
``router.refresh()`` runs one round of the health and load checks by hand, so
no test waits on the background loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Optional

import pytest
from prometheus_client.parser import text_string_to_metric_families

import frontend.router
from backend.types.errors import InvalidRequestError
from backend.types.outputs import EngineLoad, EngineOutput, FinishReason, ModelInfo
from backend.types.sampling_params import SamplingParams
from frontend.grpc_client import BackendCredentialsError, BackendOverloadedError, BackendUnavailableError
from frontend.router import Router, Target, parse_targets, prefix_key

MODEL = ModelInfo("tiny", 128, 384)


class FakeBackend:
    """A backend client: answers health and load as told, streams two tokens per request."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.healthy = True
        self.load = 0
        self.model = MODEL
        self.fingerprint = "f" * 64
        self.served: list[list[int]] = []
        self.fail_before_output: Optional[Exception] = None
        self.fail_after_output: Optional[Exception] = None
        self.aborted: list[str] = []
        self.closed = False
        self.answers_when_unhealthy = False  # its health checks miss, yet it serves (a busy backend)
        self.num_running = 0  # what its GetMetrics reports
        self.metrics_error: Optional[Exception] = None
        self.model_error: Optional[Exception] = None  # what GetModelInfo raises (health stays open)

    async def health(self) -> bool:
        return self.healthy

    async def get_load(self) -> EngineLoad:
        return EngineLoad(self.load, 0, 0.0)

    async def model_info(self) -> ModelInfo:
        if self.model_error is not None:
            raise self.model_error
        return self.model

    async def tokenizer_fingerprint(self) -> str:
        return self.fingerprint

    def expect_tokenizer(self, fingerprint: str) -> None:  # GrpcEngineClient re-checks it on reconnection
        self.expected_fingerprint = fingerprint

    async def generate(self, request_id, prompt_token_ids, params, **options):
        if self.fail_before_output is not None:
            raise self.fail_before_output
        if not self.healthy and not self.answers_when_unhealthy:
            raise BackendUnavailableError(f"{self.address}: connection refused")
        self.served.append(list(prompt_token_ids))
        yield EngineOutput(request_id, 0, [1])
        if self.fail_after_output is not None:
            raise self.fail_after_output
        yield EngineOutput(request_id, 0, [2], finish_reason=FinishReason.LENGTH)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def metrics_text(self) -> str:
        if self.metrics_error is not None:
            raise self.metrics_error
        return ("# HELP tandem:num_requests_running Running sequences.\n"
                "# TYPE tandem:num_requests_running gauge\n"
                f'tandem:num_requests_running{{model_name="tiny"}} {self.num_running}\n'
                "# HELP tandem:generation_tokens_total Tokens generated.\n"
                "# TYPE tandem:generation_tokens_total counter\n"
                f'tandem:generation_tokens_total{{model_name="tiny"}} {10 * self.num_running}\n')

    async def close(self) -> None:
        self.closed = True


def make_router(addresses=("a:1", "b:1", "c:1"), **kwargs) -> tuple[Router, dict[str, FakeBackend]]:
    fakes: dict[str, FakeBackend] = {}

    def factory(address: str) -> FakeBackend:
        fakes[address] = FakeBackend(address)
        return fakes[address]

    router = Router(parse_targets(",".join(addresses)), client_factory=factory, **kwargs)
    return router, fakes


async def refresh(router: Router, rounds: int = 2) -> None:
    """Enough check rounds for a health change to take effect (one missed check is no verdict)."""
    for _ in range(rounds):
        await router.refresh()


async def send(router: Router, prompt: list[int], request_id: str = "r") -> list[int]:
    return [t for output in [o async for o in router.generate(request_id, prompt, SamplingParams())]
            for t in output.new_token_ids]


def serving(fakes: dict[str, FakeBackend], prompt: list[int]) -> list[str]:
    return [address for address, fake in fakes.items() if prompt in fake.served]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# ---- targets ------------------------------------------------------------------------------------


def test_parse_targets():
    assert parse_targets("a:50051, dns:///backend:50052,[::1]:7") == [
        Target("a", 50051, False), Target("backend", 50052, True), Target("::1", 7, False)]
    assert Target("::1", 7, False).address == "[::1]:7"
    for bad in ("a", "a:", "a:x", ":1", "a:70000", "a:1,a:1", "dns:///b"):
        with pytest.raises(InvalidRequestError) as error:
            parse_targets(bad)
        assert error.value.param == "backend"


def test_bad_router_settings_are_refused():
    with pytest.raises(InvalidRequestError, match="--routing must be one of"):
        make_router(policy="random")
    with pytest.raises(InvalidRequestError, match="--routing-prefix-tokens"):
        make_router(prefix_tokens=0)


# ---- affinity -----------------------------------------------------------------------------------


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


# ---- load -----------------------------------------------------------------------------------------


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


# ---- health -------------------------------------------------------------------------------------


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


def test_abort_goes_to_the_backend_running_the_request():
    async def scenario():
        router, fakes = make_router()
        await router.refresh()
        stream = router.generate("req-1", [3] * 8, SamplingParams())
        await anext(stream)
        await router.abort("req-1")
        await router.abort("unknown")
        await stream.aclose()
        await router.close()
        return {a: f.aborted for a, f in fakes.items() if f.aborted}

    aborted = run(scenario())
    assert list(aborted.values()) == [["req-1"]]


def test_closing_a_stream_closes_the_backend_clients_stream_at_once():
    """The backend client's stream is closed with the router's, in the same task (its cleanup,
    e.g. an abort, is not left to the event loop's finalizer for async generators)."""
    async def scenario():
        router, fakes = make_router(("a:1",))
        await router.refresh()
        closed = []

        async def generate(request_id, prompt_token_ids, params, **options):
            try:
                yield EngineOutput(request_id, 0, [1])
                yield EngineOutput(request_id, 0, [2], finish_reason=FinishReason.LENGTH)
            finally:
                closed.append(request_id)

        fakes["a:1"].generate = generate
        stream = router.generate("r", [3], SamplingParams())
        await anext(stream)
        await stream.aclose()
        closed_with_it = list(closed)  # before any other task or callback has run
        await router.close()
        return closed_with_it

    assert run(scenario()) == ["r"]


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


def test_metrics_text_merges_the_usable_backends_families_labelled_by_backend():
    async def scenario():
        router, fakes = make_router()
        await router.refresh()
        for i, fake in enumerate(fakes.values()):
            fake.num_running = i + 1
        all_three = await router.metrics_text()
        fakes["b:1"].metrics_error = BackendUnavailableError("b:1: connection refused")
        fakes["c:1"].healthy = False
        await refresh(router)
        only_a = await router.metrics_text()
        await router.close()
        return all_three, only_a

    def samples(text):
        families = list(text_string_to_metric_families(text))
        assert len({f.name for f in families}) == len(families)  # each family once
        return {(s.name, s.labels["backend"]): s.value for f in families for s in f.samples}

    all_three, only_a = run(scenario())
    assert samples(all_three) == {
        **{("tandem:num_requests_running", b): n for b, n in (("a:1", 1), ("b:1", 2), ("c:1", 3))},
        **{("tandem:generation_tokens_total", b): 10 * n for b, n in (("a:1", 1), ("b:1", 2), ("c:1", 3))}}
    assert samples(only_a) == {("tandem:num_requests_running", "a:1"): 1,
                               ("tandem:generation_tokens_total", "a:1"): 10}


# ---- DNS ----------------------------------------------------------------------------------------


def test_dns_targets_follow_the_names_addresses(monkeypatch):
    answers = {"backend": ["10.0.0.1", "10.0.0.2"]}

    async def fake_getaddrinfo(host, port, type=0, **_):
        if host not in answers:
            raise socket.gaierror("no such name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[host]]

    async def scenario():
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", fake_getaddrinfo)
        router, fakes = make_router(("dns:///backend:50051",), resolve_interval=0)
        await router.refresh()
        first = sorted(router.backends)
        answers["backend"] = ["10.0.0.2", "10.0.0.3"]  # .1 replaced by .3
        await router.refresh()
        second = sorted(router.backends)
        closed = fakes["10.0.0.1:50051"].closed
        del answers["backend"]  # a DNS failure keeps what it had
        await router.refresh()
        third = sorted(router.backends)
        await router.close()
        return first, second, closed, third

    first, second, closed, third = run(scenario())
    assert first == ["10.0.0.1:50051", "10.0.0.2:50051"]
    assert second == ["10.0.0.2:50051", "10.0.0.3:50051"] and closed
    assert third == second


# ---- credentials refused ----------------------------------------------------------------------------


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
