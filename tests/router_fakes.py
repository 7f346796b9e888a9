"""Fake backend clients for the router's tests (frontend/router.py), and the helpers those tests share.

Each fake stands for one backend address and records the requests it served;
``router.refresh()`` runs one round of the health and load checks by hand, so
no test waits on the background loop.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from backend.types.outputs import EngineLoad, EngineOutput, FinishReason, ModelInfo
from backend.types.sampling_params import SamplingParams
from frontend.grpc_client import BackendUnavailableError
from frontend.router import Router, parse_targets

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
