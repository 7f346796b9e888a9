"""The router's backends as given (frontend/router.py): parsing --backend targets, refusing bad
settings, and following a DNS name's addresses.

The backends are fakes (tests/router_fakes.py).
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from router_fakes import make_router, run

from backend.types.errors import InvalidRequestError
from frontend.router import Target, parse_targets


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
