"""The frontend's MultiplexedStream (frontend/multiplexed_stream.py) through its client
(frontend/grpc_client.py) against the stand-in backend (tests/stand_in_backend.py), which can refuse
the RPC as an older backend does and can be stopped mid-stream: the fallback to Generate, aborts
sent and not sent, the backend's death and restart, refusals, and calls that age out.

The real backend's side of GenerateStream is in tests/test_generate_stream_backend.py. Every wait
is bounded.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from stand_in_backend import StandInServicer, start_server

from backend.types.errors import InvalidRequestError
from backend.types.outputs import FinishReason
from backend.types.sampling_params import SamplingParams
from frontend.grpc_client import BackendOverloadedError, BackendUnavailableError, GrpcEngineClient
from protos.tandem.engine.v1 import engine_pb2


# ---- the frontend's client over the stand-in ----------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from conftest import build_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    return str(directory)


async def _serve_stand_in(tokenizer_dir: str, port: int = 0, **options):
    servicer = StandInServicer(tokenizer_dir, **options)
    server, port = await start_server(servicer, port=port)
    return servicer, server, port


@pytest.mark.timeout(60)
def test_fallback_to_generate_against_a_backend_without_the_rpc(tokenizer_dir):
    async def run(generate_stream: bool):
        servicer, server, port = await _serve_stand_in(tokenizer_dir, generate_stream=generate_stream)
        client = GrpcEngineClient(f"127.0.0.1:{port}")
        try:
            async def one(i):
                return [o async for o in client.generate(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8))]

            first = await asyncio.gather(*(one(i) for i in range(6)))  # all probing the RPC at once
            later = await asyncio.gather(*(one(i) for i in range(6, 9)))
            return (first + later, servicer.num_generate_calls, servicer.num_generate_stream_calls,
                    servicer.num_stream_messages)
        finally:
            await client.close()
            await server.stop(None)

    outputs, unary_calls, stream_calls, messages = asyncio.run(asyncio.wait_for(run(False), 30))
    assert [len(o) for o in outputs] == [8] * 9 and all(o[-1].finish_reason == FinishReason.LENGTH for o in outputs)
    assert unary_calls == 9 and stream_calls == 1  # refused once, then not asked again

    multiplexed, unary_calls, stream_calls, messages = asyncio.run(asyncio.wait_for(run(True), 30))
    assert unary_calls == 0 and stream_calls == 1
    assert messages < 9 * 8  # many requests' tokens per message
    strip = lambda runs: [[(o.index, o.new_token_ids, o.finish_reason) for o in run] for run in runs]  # noqa: E731
    assert strip(multiplexed) == strip(outputs)


@pytest.mark.timeout(60)
def test_a_request_whose_end_came_sends_no_abort_when_its_reader_stops_at_its_last_delta(tokenizer_dir):
    """The frontend stops reading a request at its last delta (before the status behind it): the
    backend has ended it, so no abort goes out; one stopped before its end is aborted."""
    async def run():
        # A step of 20 ms and a cut request of 200 tokens: its end cannot reach the client before its
        # reader stops (with no pause, all of it could already be buffered, and then no abort is due).
        servicer, server, port = await _serve_stand_in(tokenizer_dir, step_ms=20)
        client = GrpcEngineClient(f"127.0.0.1:{port}")
        try:
            async def until(request_id: str, stop_after: int, max_tokens: int = 4) -> int:
                seen = 0
                async for output in client.generate(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens)):
                    seen += 1
                    if output.finish_reason is not None or seen == stop_after:
                        break
                return seen

            whole = await asyncio.gather(*(until(f"whole-{i}", 0) for i in range(3)))
            await asyncio.sleep(0.2)  # any abort would have gone out by now
            aborts_after_whole = servicer.num_stream_aborts
            cut = await until("cut", 2, max_tokens=200)
            deadline = time.monotonic() + 10
            while servicer.num_stream_aborts == aborts_after_whole and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return whole, aborts_after_whole, cut, servicer.num_stream_aborts - aborts_after_whole
        finally:
            await client.close()
            await server.stop(None)

    whole, aborts_after_whole, cut, aborts_after_cut = asyncio.run(asyncio.wait_for(run(), 30))
    assert whole == [4, 4, 4] and aborts_after_whole == 0
    assert cut == 2 and aborts_after_cut == 1


@pytest.mark.timeout(60)
def test_closing_a_request_early_drops_it_from_the_call_at_once(tokenizer_dir):
    """Closing the client's stream of a request closes the call's stream of it in the same task:
    the call forgets the request (and queues its abort) before anything else runs."""
    async def run():
        servicer, server, port = await _serve_stand_in(tokenizer_dir, step_ms=5)
        client = GrpcEngineClient(f"127.0.0.1:{port}")
        try:
            stream = client.generate("early", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
            await anext(stream)
            call = client._streams[-1]
            running = call.has("early")
            await stream.aclose()
            return running, call.has("early")
        finally:
            await client.close()
            await server.stop(None)

    assert asyncio.run(asyncio.wait_for(run(), 30)) == (True, False)


@pytest.mark.timeout(60)
def test_backend_death_mid_stream_fails_every_open_request_and_a_new_call_follows_its_restart(tokenizer_dir):
    async def run():
        servicer, server, port = await _serve_stand_in(tokenizer_dir, step_ms=5)
        client = GrpcEngineClient(f"127.0.0.1:{port}")
        try:
            started = [asyncio.Event() for _ in range(4)]

            async def one(i):
                async for _ in client.generate(f"open-{i}", [1, 2], SamplingParams(max_tokens=100_000)):
                    started[i].set()

            requests = [asyncio.ensure_future(one(i)) for i in range(4)]
            await asyncio.gather(*(event.wait() for event in started))
            await server.stop(None)  # the backend dies with four requests open on the call
            results = await asyncio.gather(*requests, return_exceptions=True)
            healthy_while_down = await client.health()
            _, server, _ = await _serve_stand_in(tokenizer_dir, port=port)
            deadline = time.monotonic() + 20
            while True:  # the channel reconnects within about a second (RECONNECT_BACKOFF_MS)
                try:
                    after = [o async for o in client.generate("after", [1], SamplingParams(max_tokens=3))]
                    break
                except BackendUnavailableError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
            return results, healthy_while_down, after
        finally:
            await client.close()
            await server.stop(None)

    results, healthy_while_down, after = asyncio.run(asyncio.wait_for(run(), 45))
    assert [type(r) for r in results] == [BackendUnavailableError] * 4, results
    assert healthy_while_down is False
    assert after[-1].finish_reason == FinishReason.LENGTH and len(after) == 3


@pytest.mark.timeout(60)
def test_a_refusal_on_the_call_reaches_the_router_as_on_generate(tokenizer_dir):
    """RESOURCE_EXHAUSTED in a request's status is BackendOverloadedError (the router's cue to try
    another backend); a request ID already open on the call is refused here, before it is sent."""
    class Refusing(StandInServicer):
        async def GenerateStream(self, requests, context):
            async for message in requests:
                await context.write(engine_pb2.GenerateStreamResponse(requests=[engine_pb2.RequestDeltas(
                    request_id=item.request.request_id, status=engine_pb2.RequestStatus(
                        code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="full"))
                    for item in message.requests]))

    async def run():
        server, port = await start_server(Refusing(tokenizer_dir))
        client = GrpcEngineClient(f"127.0.0.1:{port}")
        try:
            with pytest.raises(BackendOverloadedError, match="full"):
                async for _ in client.generate("refused", [1], SamplingParams(max_tokens=2)):
                    pass
        finally:
            await client.close()
            await server.stop(None)

        servicer, server, port = await _serve_stand_in(tokenizer_dir, step_ms=5)
        client = GrpcEngineClient(f"127.0.0.1:{port}")
        try:
            first = client.generate("twice", [1], SamplingParams(max_tokens=1000))
            await anext(first)
            with pytest.raises(InvalidRequestError) as duplicate:
                async for _ in client.generate("twice", [1], SamplingParams(max_tokens=2)):
                    pass
            await first.aclose()
            return duplicate.value
        finally:
            await client.close()
            await server.stop(None)

    duplicate = asyncio.run(asyncio.wait_for(run(), 30))
    assert duplicate.param == "request_id"


@pytest.mark.timeout(60)
def test_an_old_call_takes_no_new_requests_and_ends_once_its_own_have(tokenizer_dir, monkeypatch):
    """Past STREAM_MAX_AGE_S a call is half-closed: new requests open a new call (so connection
    ageing and DNS changes still move traffic), while those running on the old one finish there."""
    import frontend.grpc_client as grpc_client

    async def run():
        servicer, server, port = await _serve_stand_in(tokenizer_dir, step_ms=2)
        client = GrpcEngineClient(f"127.0.0.1:{port}")
        try:
            old = client.generate("on-the-old-call", [1], SamplingParams(max_tokens=40))
            await anext(old)
            monkeypatch.setattr(grpc_client, "STREAM_MAX_AGE_S", 0.0)
            new = [o async for o in client.generate("on-a-new-call", [2], SamplingParams(max_tokens=3))]
            rest = [o async for o in old]
            calls = servicer.num_generate_stream_calls
            monkeypatch.setattr(grpc_client, "STREAM_MAX_AGE_S", 60.0)
            deadline = time.monotonic() + 10
            while not client._streams[0].ended:  # the old call ends by itself, its request done
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            return new, rest, calls
        finally:
            await client.close()
            await server.stop(None)

    new, rest, calls = asyncio.run(asyncio.wait_for(run(), 30))
    assert calls == 2
    assert new[-1].finish_reason == FinishReason.LENGTH and len(new) == 3
    assert rest[-1].finish_reason == FinishReason.LENGTH and len(rest) == 39
