"""GenerateStream on the real backend (backend/server/generate_stream.py), on CPU: many requests on
one call, driven with the generated stubs as any client would, and the frontend's client
(frontend/grpc_client.py with frontend/multiplexed_stream.py) sharing one call.

The backend is the real server on a tiny random Llama (as tests/test_grpc_server.py). Every call
has a deadline and every wait is bounded. The frontend's side against the stand-in backend is in
tests/test_multiplexed_stream.py.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections import defaultdict
from dataclasses import dataclass, field

import grpc
import pytest
from helpers import LoopThread
from test_grpc_server import slow_steps  # noqa: F401 -- the fixture (each step 10 ms longer), on this file's backend

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.server.auth import ServerSecurity
from backend.server.grpc_server import BackendServer
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError, RequestTimeoutError
from backend.types.limits import Limits
from backend.types.outputs import FinishReason
from backend.types.sampling_params import SamplingParams
from frontend.grpc_client import BackendCredentialsError, ChannelSecurity, GrpcEngineClient
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

NUM_BLOCKS = 64
VOCAB = 384  # conftest's tiny models
OK, FINISH = grpc.StatusCode.OK.value[0], engine_pb2.FinishReason
TOKEN = "stream-token-0123456789abcdef"


@dataclass
class Backend:
    engine: AsyncLLMEngine
    loop: LoopThread
    server: BackendServer
    channel: grpc.Channel

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def stub(self) -> engine_pb2_grpc.EngineServiceStub:
        return engine_pb2_grpc.EngineServiceStub(self.channel)


@pytest.fixture(scope="module")
def backend(tiny_checkpoint):
    loop = LoopThread()
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32",
                                         num_kv_blocks=NUM_BLOCKS, block_size=4, max_model_len=64, max_num_seqs=4))
    server = BackendServer(engine, "127.0.0.1", 0)
    loop.run(server.start())
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield Backend(engine, loop, server, channel)
    channel.close()
    loop.run(server.stop(0))
    engine.shutdown()
    loop.close()


def streamed(request_id: str, prompt: list[int], timeout_ms=None, **params) -> engine_pb2.StreamedGenerateRequest:
    item = engine_pb2.StreamedGenerateRequest(request=engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=engine_pb2.SamplingParams(**params)))
    if timeout_ms is not None:
        item.timeout_ms = timeout_ms
    return item


@dataclass
class Ended:
    """What one request got on a GenerateStream call."""

    responses: list = field(default_factory=list)
    status: engine_pb2.RequestStatus = None


class StreamCall:
    """A GenerateStream call driven from the test's thread with the sync stubs."""

    def __init__(self, stub: engine_pb2_grpc.EngineServiceStub, metadata=(), timeout: float = 60) -> None:
        self._outgoing: queue.Queue = queue.Queue()
        self.call = stub.GenerateStream(iter(self._outgoing.get, None), timeout=timeout, metadata=metadata)
        self.requests: dict[str, Ended] = defaultdict(Ended)
        self.entries_per_message: list[int] = []

    def send(self, *items: engine_pb2.StreamedGenerateRequest, abort=()) -> None:
        self._outgoing.put(engine_pb2.GenerateStreamRequest(requests=items, abort_request_ids=abort))

    def half_close(self) -> None:
        self._outgoing.put(None)

    def read_one(self) -> engine_pb2.GenerateStreamResponse:
        message = next(self.call)
        self.entries_per_message.append(len(message.requests))
        for entry in message.requests:
            ended = self.requests[entry.request_id]
            assert ended.status is None, f"{entry.request_id} has news after its status"
            ended.responses.extend(entry.responses)
            if entry.HasField("status"):
                ended.status = entry.status
        return message

    def read_until_ended(self, request_ids) -> dict[str, Ended]:
        while any(self.requests[r].status is None for r in request_ids):
            self.read_one()
        return self.requests


def wait_until_idle(backend: Backend, timeout: float = 10.0) -> None:
    """Nothing runs, waits or holds a KV block."""
    deadline = time.monotonic() + timeout
    while True:
        load = backend.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        free = backend.engine.engine.block_manager.num_free_blocks
        if (load.num_requests_running, load.num_requests_waiting, free) == (0, 0, NUM_BLOCKS):
            return
        assert time.monotonic() < deadline, f"backend still busy after {timeout} s: {load}, {free} free blocks"
        time.sleep(0.05)


def finishes(ended: Ended) -> dict[int, int]:
    return {r.index: r.finish_reason for r in ended.responses if r.finish_reason}


# ---- the backend's side, through the stubs ----------------------------------------------------------


@pytest.mark.timeout(120)
def test_many_requests_interleave_on_one_call_each_as_its_own_generate_call(backend):
    cases = {f"req-{i}": ([3 + i, 17, 29, 5 + 2 * i], dict(temperature=0.0, max_tokens=4 + i)) for i in range(6)}
    cases["req-n2"] = ([7, 7, 9], dict(temperature=0.0, max_tokens=5, n=2, logprobs=2, prompt_logprobs=1))
    call = StreamCall(backend.stub)
    call.send(*(streamed(request_id, prompt, **params) for request_id, (prompt, params) in cases.items()))
    call.half_close()
    ended = call.read_until_ended(cases)
    assert list(call.call) == []  # half-closed and every request ended: the call ends...
    assert call.call.code() == grpc.StatusCode.OK  # ...with OK

    for request_id, (prompt, params) in cases.items():
        alone = list(backend.stub.Generate(engine_pb2.GenerateRequest(
            request_id=f"alone-{request_id}", prompt_token_ids=prompt,
            sampling_params=engine_pb2.SamplingParams(**params)), timeout=30))
        assert ended[request_id].status.code == OK and ended[request_id].status.message == ""
        # Greedy: each sequence gets the same responses in the same order (how the n sequences of
        # one request interleave depends on what else the engine runs).
        for index in range(params.get("n", 1)):
            assert [r for r in ended[request_id].responses if r.index == index] == \
                [r for r in alone if r.index == index], (request_id, index)
    assert max(call.entries_per_message) > 1  # requests shared messages: one per step, not per request
    wait_until_idle(backend)


@pytest.mark.timeout(120)
def test_abort_of_one_request_leaves_the_others_running(backend, slow_steps):
    call = StreamCall(backend.stub)
    call.send(*(streamed(r, [4, 8, 15], temperature=0.0, max_tokens=30) for r in ("keep-a", "victim", "keep-b")))
    while not call.requests["victim"].responses:
        call.read_one()
    call.send(abort=["victim", "not-running"])  # an unknown ID is ignored
    call.half_close()
    ended = call.read_until_ended(["keep-a", "victim", "keep-b"])
    victim = ended["victim"]
    assert victim.status.code == OK and finishes(victim) == {0: FINISH.FINISH_REASON_ABORT}
    assert victim.responses[-1].num_completion_tokens < 30
    for kept in ("keep-a", "keep-b"):
        assert ended[kept].status.code == OK and finishes(ended[kept]) == {0: FINISH.FINISH_REASON_LENGTH}
        assert ended[kept].responses[-1].num_completion_tokens == 30
    wait_until_idle(backend)


@pytest.mark.timeout(120)
def test_deadline_of_one_request_ends_it_alone(backend, slow_steps):
    call = StreamCall(backend.stub)
    call.send(streamed("late", [1, 2, 3], timeout_ms=150, max_tokens=50, ignore_eos=True),
              streamed("on-time", [1, 2, 4], max_tokens=20, ignore_eos=True))
    call.half_close()
    started = time.monotonic()
    ended = call.read_until_ended(["late", "on-time"])
    assert ended["late"].status.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "deadline" in ended["late"].status.message
    assert time.monotonic() - started < 10
    assert ended["on-time"].status.code == OK and ended["on-time"].responses[-1].num_completion_tokens == 20
    wait_until_idle(backend)


@pytest.mark.timeout(120)
def test_a_bad_request_is_refused_alone_with_its_code_and_parameter(backend):
    call = StreamCall(backend.stub)
    call.send(streamed("good-1", [5, 6], max_tokens=3),
              streamed("bad-token", [1, VOCAB], max_tokens=3),
              streamed("bad-temperature", [1, 2], temperature=float("nan")),
              streamed("", [1, 2]),
              streamed("good-2", [6, 5], max_tokens=3))
    call.half_close()
    ended = call.read_until_ended(["good-1", "bad-token", "bad-temperature", "", "good-2"])
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    for request_id, param in (("bad-token", "prompt"), ("bad-temperature", "temperature"), ("", "request_id")):
        assert (ended[request_id].status.code, ended[request_id].status.error_param) == (invalid, param)
        assert ended[request_id].responses == [] and ended[request_id].status.message
    for good in ("good-1", "good-2"):
        assert ended[good].status.code == OK and ended[good].responses[-1].num_completion_tokens == 3
    # The same refusals as Generate's, code and parameter.
    with pytest.raises(grpc.RpcError) as unary:
        list(backend.stub.Generate(streamed("bad-token-unary", [1, VOCAB]).request, timeout=30))
    assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(unary.value.trailing_metadata())["tandem-error-param"] == "prompt"
    assert unary.value.details() == ended["bad-token"].status.message
    wait_until_idle(backend)


@pytest.mark.timeout(120)
def test_admission_refuses_the_request_past_the_limit_alone(backend, slow_steps):
    """A second server on the same engine, admitting max_num_seqs (4) sequences and one more waiting."""
    second = BackendServer(backend.engine, "127.0.0.1", 0, limits=Limits(max_num_queued_requests=1))
    backend.loop.run(second.start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{second.port}") as channel:
            call = StreamCall(engine_pb2_grpc.EngineServiceStub(channel))
            names = [f"admit-{i}" for i in range(6)]
            call.send(*(streamed(name, [2, 3, i], max_tokens=10, ignore_eos=True) for i, name in enumerate(names)))
            call.half_close()
            ended = call.read_until_ended(names)
            codes = [ended[name].status.code for name in names]
            assert codes == [OK] * 5 + [grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
            assert "sequences in flight" in ended["admit-5"].status.message
    finally:
        backend.loop.run(second.stop(0))
    wait_until_idle(backend)


@pytest.mark.timeout(120)
def test_cancelling_the_call_aborts_every_request_on_it(backend, slow_steps):
    call = StreamCall(backend.stub)
    call.send(*(streamed(f"cut-{i}", [9, 9, i], max_tokens=50, ignore_eos=True) for i in range(3)))
    while len(call.requests) < 3:
        call.read_one()
    call.call.cancel()
    wait_until_idle(backend)  # every request aborted, every block freed


@pytest.mark.timeout(120)
def test_generate_stream_needs_the_token_like_every_call(backend):
    secured = BackendServer(backend.engine, "127.0.0.1", 0, security=ServerSecurity(auth_token=TOKEN))
    backend.loop.run(secured.start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{secured.port}") as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            refused = StreamCall(stub, metadata=(("authorization", "Bearer wrong"),))
            refused.send(streamed("no-token", [1, 2], max_tokens=2))
            with pytest.raises(grpc.RpcError) as error:
                refused.read_one()
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            refused.half_close()
            allowed = StreamCall(stub, metadata=(("authorization", f"Bearer {TOKEN}"),))
            allowed.send(streamed("with-token", [1, 2], max_tokens=2))
            allowed.half_close()
            assert allowed.read_until_ended(["with-token"])["with-token"].status.code == OK

        async def client_run(security: ChannelSecurity):
            client = GrpcEngineClient(f"127.0.0.1:{secured.port}", security=security)
            try:
                return [o async for o in client.generate("via-client", [1, 2], SamplingParams(max_tokens=2))]
            finally:
                await client.close()

        assert asyncio.run(client_run(ChannelSecurity(auth_token=TOKEN)))[-1].finish_reason == FinishReason.LENGTH
        with pytest.raises(BackendCredentialsError, match="UNAUTHENTICATED"):
            asyncio.run(client_run(ChannelSecurity(auth_token="wrong")))
    finally:
        backend.loop.run(secured.stop(0))


# ---- the frontend's client over the real backend ----------------------------------------------------


@pytest.mark.timeout(120)
def test_client_requests_share_the_call_and_keep_their_typed_errors(backend, slow_steps):
    prompts = {f"c{i}": [11 + i, 12, 13] for i in range(5)}
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)

    async def run():
        multiplexed, unary = GrpcEngineClient(backend.address), GrpcEngineClient(backend.address, multiplexed=False)
        try:
            async def collect(client, request_id, prompt):
                return [o async for o in client.generate(request_id, prompt, params)]

            together = await asyncio.gather(*(collect(multiplexed, r, p) for r, p in prompts.items()))
            alone = [await collect(unary, r, p) for r, p in prompts.items()]
            (stream,) = multiplexed._streams  # one call carried them all

            with pytest.raises(InvalidRequestError) as bad:
                await collect(multiplexed, "bad", [1, VOCAB])
            with pytest.raises(RequestTimeoutError):
                async for _ in multiplexed.generate("late", [1, 2], SamplingParams(max_tokens=60, ignore_eos=True),
                                                    deadline=time.monotonic() + 0.1):
                    pass

            # Closing one early aborts it on the backend; the others go on.
            survivor = asyncio.ensure_future(collect(multiplexed, "survivor", [5, 5]))
            closed = multiplexed.generate("closed-early", [6, 6], SamplingParams(max_tokens=60, ignore_eos=True))
            await anext(closed)
            await closed.aclose()

            # Abort from the side ends it with ABORT, as on Generate.
            seen = []

            async def consume():
                async for output in multiplexed.generate("aborted", [7, 7], SamplingParams(max_tokens=60,
                                                                                            ignore_eos=True)):
                    seen.append(output)

            consumer = asyncio.ensure_future(consume())
            while not seen:
                await asyncio.sleep(0.01)
            await multiplexed.abort("aborted")
            await asyncio.wait_for(consumer, 10)
            return together, alone, bad.value, await survivor, seen, multiplexed._streams == [stream]
        finally:
            await multiplexed.close()
            await unary.close()

    together, alone, bad, survivor, seen, same_call = asyncio.run(asyncio.wait_for(run(), 60))
    assert together == alone  # the same EngineOutputs, logprobs included
    assert bad.param == "prompt" and "out of vocabulary" in bad.message
    assert survivor[-1].finish_reason == FinishReason.LENGTH
    assert seen[-1].finish_reason == FinishReason.ABORT and not seen[-1].new_token_ids
    assert same_call
    wait_until_idle(backend)
