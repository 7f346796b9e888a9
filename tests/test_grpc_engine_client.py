"""The frontend's GrpcEngineClient against the backend's gRPC server, and the server's shutdown
(drain, cancel after the timeout, SIGTERM), on CPU: the module's server of tests/test_grpc_server.py
(a tiny random Llama, on an event loop of its own thread). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import free_port
from test_grpc_server import (FINISH, REPO_ROOT, VOCAB, backend, generate_request, generated_tokens,  # noqa: F401
                              reference_outputs, slow_steps, wait_until_idle)

from backend.server.grpc_server import BackendServer
from backend.types.errors import InvalidRequestError, RequestFailedError, RequestTimeoutError
from backend.types.outputs import FinishReason
from backend.types.sampling_params import SamplingParams
from frontend.grpc_client import (BackendError, BackendOverloadedError, BackendUnavailableError, GrpcEngineClient,
                                  error_from_status)
from protos.tandem.engine.v1 import engine_pb2_grpc


# ---- GrpcEngineClient -----------------------------------------------------------------------------


def test_grpc_engine_client_is_an_engine_client(backend, slow_steps):
    prompt = [42, 43, 44, 45]
    # A stop token the greedy run reaches, so stop_token_ids and stop_reason cross the wire too.
    unstopped = reference_outputs(backend.model_dir, prompt, SamplingParams(temperature=0.0, max_tokens=8))
    stop_token = unstopped[3].new_token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, prompt_logprobs=2, stop_token_ids=[stop_token])
    expected = reference_outputs(backend.model_dir, prompt, params)
    assert expected[-1].stop_reason == stop_token

    async def run():
        client = GrpcEngineClient(backend.address)
        try:
            outputs = [o async for o in client.generate("via-client", prompt, params)]
            info, load, healthy = await client.model_info(), await client.get_load(), await client.health()

            # Closing the iterator early cancels the call, which aborts the request.
            before = generated_tokens(backend)
            stream = client.generate("closed-early", [7, 7, 7], SamplingParams(max_tokens=50))
            first = await anext(stream)
            await stream.aclose()
            while (await client.get_load()).num_requests_running:  # bounded by the wait_for below
                await asyncio.sleep(0.01)
            assert generated_tokens(backend) - before < 50

            # Abort from the side: the stream gets an ABORT output and ends.
            seen = []

            async def consume():
                async for output in client.generate("aborted-by-client", [6, 6], SamplingParams(max_tokens=200)):
                    seen.append(output)

            consumer = asyncio.create_task(consume())
            while not seen:
                await asyncio.sleep(0.01)
            await client.abort("aborted-by-client")
            await asyncio.wait_for(consumer, 10)

            with pytest.raises(InvalidRequestError) as bad:  # rejected by the backend, typed here
                async for _ in client.generate("bad", [1, VOCAB], SamplingParams(max_tokens=3)):
                    pass
            return outputs, info, load, healthy, first, seen, bad.value
        finally:
            await client.close()

    outputs, info, load, healthy, first, seen, bad = asyncio.run(asyncio.wait_for(run(), 30))
    # The EngineOutputs round-trip exactly (logprobs are float32 on both sides).
    for output in outputs + expected:
        output.request_id = "x"
    assert outputs == expected
    assert info == dataclasses.replace(backend.engine.engine.model_info(), tokenizer_path=None)
    assert healthy and load.kv_cache_usage == 0.0
    assert first.finish_reason is None and first.new_token_ids
    assert seen[-1].finish_reason == FinishReason.ABORT and not seen[-1].new_token_ids
    assert bad.param == "prompt" and "out of vocabulary" in bad.message
    wait_until_idle(backend)


@pytest.mark.parametrize("code, kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequestError),
    (grpc.StatusCode.UNAVAILABLE, BackendUnavailableError),
    (grpc.StatusCode.DEADLINE_EXCEEDED, RequestTimeoutError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, BackendOverloadedError),
    (grpc.StatusCode.INTERNAL, RequestFailedError),  # one request failed in the backend, which goes on
    (grpc.StatusCode.UNIMPLEMENTED, BackendError),
])
def test_status_codes_become_typed_errors(code, kind):
    trailing = grpc.aio.Metadata(("tandem-error-param", "top_p"))
    error = error_from_status(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details="what went wrong"))
    assert type(error) is kind and "what went wrong" in str(error)
    if kind is InvalidRequestError:
        assert error.param == "top_p"
    if kind is BackendError:
        assert error.code == code


def test_grpc_engine_client_reports_an_unreachable_backend():
    async def run():
        client = GrpcEngineClient(f"127.0.0.1:{free_port()}")
        try:
            with pytest.raises(InvalidRequestError, match="out of range"):
                async for _ in client.generate("negative", [1, -1], SamplingParams()):
                    pass
            assert await client.health() is False
            with pytest.raises(BackendUnavailableError):
                await client.get_load()
            with pytest.raises(BackendUnavailableError):
                async for _ in client.generate("nowhere", [1], SamplingParams()):
                    pass
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_frontend_grpc_client_does_not_import_torch():
    code = "import sys, frontend.grpc_client; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, timeout=60).returncode == 0


# ---- shutdown ------------------------------------------------------------------------------------


def test_stop_drains_running_streams_and_refuses_new_ones(backend, slow_steps):
    """A second server on the same engine (a server does not own its engine)."""
    second = BackendServer(backend.engine, "127.0.0.1", 0)
    backend.loop.run(second.start())
    with grpc.insecure_channel(f"127.0.0.1:{second.port}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        call = stub.Generate(generate_request("drained", [2, 7, 1], max_tokens=30), timeout=30)
        responses = [next(call)]
        stopping = asyncio.run_coroutine_threadsafe(second.stop(10), backend.loop.loop)

        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 5
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while health.Check(health_pb2.HealthCheckRequest(), timeout=2).status != not_serving:
            assert time.monotonic() < deadline, "health never turned NOT_SERVING"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(generate_request("late", [1, 2], max_tokens=2), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
        assert not stopping.done()  # still waiting for "drained"

        responses += list(call)
        assert call.code() == grpc.StatusCode.OK
        assert responses[-1].num_completion_tokens == 30
        assert responses[-1].finish_reason == FINISH.FINISH_REASON_LENGTH
        stopping.result(timeout=5)
    wait_until_idle(backend)


def test_stop_cancels_streams_still_running_after_the_timeout(backend, slow_steps):
    """stop(timeout) cuts a stream that outlives the timeout; the engine frees it."""
    second = BackendServer(backend.engine, "127.0.0.1", 0)
    backend.loop.run(second.start())
    with grpc.insecure_channel(f"127.0.0.1:{second.port}") as channel:
        call = engine_pb2_grpc.EngineServiceStub(channel).Generate(
            generate_request("cut-at-stop", [3, 1, 4], max_tokens=200), timeout=30)
        next(call)
        started = time.monotonic()
        backend.loop.run(second.stop(0.3))
        assert time.monotonic() - started < 5
        with pytest.raises(grpc.RpcError):
            list(call)
    wait_until_idle(backend)


def test_sigterm_drains_in_flight_streams_and_exits_zero(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    process = subprocess.Popen(
        [sys.executable, "-m", "backend.server", str(model_dir), "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "4",
         # The drain waits up to 30 s: 60 tokens take ~1 s on an idle machine, several on a loaded one.
         "--max-model-len", "256", "--shutdown-timeout", "30"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port, output = None, []
        deadline = time.monotonic() + 40
        while port is None and time.monotonic() < deadline:
            output.append(process.stdout.readline())
            if not output[-1]:
                break
            match = re.search(r"Backend serving .* on 127\.0\.0\.1:(\d+)", output[-1])
            port = int(match.group(1)) if match else None
        assert port, "the server never said where it listens:\n" + "".join(output)

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            call = stub.Generate(generate_request("in-flight", [1, 2, 3], max_tokens=60), timeout=30)
            responses = [next(call)]
            process.send_signal(signal.SIGTERM)

            # Draining (or already gone, if the stream ended first): not serving, new work refused.
            deadline = time.monotonic() + 5
            while True:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                except grpc.RpcError as gone:
                    assert gone.code() == grpc.StatusCode.UNAVAILABLE
                    break
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                assert time.monotonic() < deadline, "health never turned NOT_SERVING"
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(generate_request("late", [1, 2], max_tokens=2), timeout=5))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            responses += list(call)  # the in-flight stream still completes

        assert sum(len(r.new_token_ids) for r in responses) == 60
        assert responses[-1].finish_reason == FINISH.FINISH_REASON_LENGTH
        assert process.wait(timeout=40) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
