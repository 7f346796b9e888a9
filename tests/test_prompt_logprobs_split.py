"""Prompt logprobs larger than one gRPC message (e.g. prompt_logprobs=-1 over a big vocabulary) are
split over several GenerateResponses (``prompt_logprobs_continued``) and joined again by the
frontend; a client that does not accept the split is refused before its request runs.

The wire side is checked on its own (``responses_from_output`` / ``OutputReader``), then end to end:
the real backend on a tiny random Llama (vocabulary 384) with the message limit lowered to 48 KiB,
so the whole vocabulary's logprobs over a 40-token prompt (~150 KB) must be split, on both RPCs.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import httpx
import pytest
from helpers import backend_and_frontend, tiny_llama_backend

from backend.server.generate_stream import GenerateStreamCall
from backend.server.proto_convert import prompt_logprobs_bytes_bound, responses_from_output
from backend.types.limits import Limits
from backend.types.outputs import EngineOutput, Logprob
from backend.types.sampling_params import SamplingParams
from frontend.grpc_client import GrpcEngineClient
from frontend.proto_convert import OutputReader, output_from_response
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.timeout(180)

VOCAB = 384  # conftest's tiny models
MESSAGE_LIMIT = 48 * 1024
PROMPT = [(7 * i + 3) % VOCAB for i in range(40)]


def _position(token: int, k: int) -> dict[int, Logprob]:
    position = {token: Logprob(-0.5, rank=3)}
    for j in range(k):
        position.setdefault((token + 1 + j) % VOCAB, Logprob(-1.0 - j / 8, rank=1 + j))  # exact in float32
    return position


def _output(num_positions: int, k: int, **fields) -> EngineOutput:
    prompt_logprobs = [None] + [_position(t, k) for t in range(num_positions)]
    return EngineOutput("r", fields.pop("index", 1), [5, 6], [_position(5, 2), _position(6, 2)], None,
                        num_prompt_tokens=num_positions + 1, num_cached_tokens=4, prompt_logprobs=prompt_logprobs,
                        **fields)


# ---- the wire, on its own -----------------------------------------------------------------------


@pytest.mark.parametrize("max_bytes", [1000, 3000, 20_000])
def test_a_split_is_parts_under_the_bound_that_join_into_the_unsplit_output(max_bytes):
    output = _output(60, 40)
    (whole,) = responses_from_output(output, 2, None)
    assert whole.ByteSize() > max_bytes and not whole.prompt_logprobs_continued
    responses = responses_from_output(output, 2, max_bytes)
    assert len(responses) > 1 and all(r.ByteSize() <= max_bytes for r in responses)
    *parts, last = responses
    assert all(p.prompt_logprobs_continued and not p.new_token_ids and not p.new_logprobs
               and p.finish_reason == engine_pb2.FINISH_REASON_UNSPECIFIED and p.index == 1 for p in parts)
    assert not last.prompt_logprobs_continued and list(last.new_token_ids) == [5, 6]
    assert sum(len(r.prompt_logprobs.positions) for r in responses) == 60
    reader = OutputReader("r")
    outputs = [reader.read(r) for r in responses]
    assert outputs[:-1] == [None] * len(parts)
    assert outputs[-1] == output_from_response("r", whole)
    assert outputs[-1].prompt_logprobs == output.prompt_logprobs


def test_a_response_that_fits_is_not_split_and_other_sequences_interleave():
    small = _output(3, 2, index=0)
    assert len(responses_from_output(small, 2, 100_000)) == 1
    reader = OutputReader("r")
    first = responses_from_output(_output(30, 40, index=0), 2, 4000)
    second = responses_from_output(_output(20, 30, index=1), 2, 2500)
    assert len(first) > 2 and len(second) > 2
    joined = [reader.read(r) for pair in zip(first, second) for r in pair]
    joined += [reader.read(r) for r in first[len(second):] + second[len(first):]]
    outputs = {o.index: o for o in joined if o is not None}
    assert outputs[0].prompt_logprobs == _output(30, 40).prompt_logprobs
    assert outputs[1].prompt_logprobs == _output(20, 30).prompt_logprobs


def test_the_bound_holds_the_largest_position():
    for k, vocab in ((0, 10), (5, 384), (383, 384), (49_151, 49_152)):
        output = EngineOutput("r", 0, [1], None, None, num_prompt_tokens=3, num_cached_tokens=0,
                              prompt_logprobs=[None] + [{vocab - 1: Logprob(-1e-3, rank=vocab)} | {
                                  t: Logprob(-2.5, rank=vocab - t) for t in range(k)}] * 2)
        (response,) = responses_from_output(output, 1, None)
        assert response.prompt_logprobs.ByteSize() <= prompt_logprobs_bytes_bound(3, k, vocab)


def test_generate_stream_sends_a_big_entry_in_pieces_and_ends_only_an_unsendable_response():
    """The writer's packing (``GenerateStreamCall._messages``): every message under the limit, a
    request at most once per message, each request's responses in order with its status last; a
    single response larger than any message ends its request RESOURCE_EXHAUSTED (and aborts it)."""
    limit = 8000
    aborted = []

    async def abort_requests(request_ids, caller):
        aborted.extend(request_ids)

    servicer = SimpleNamespace(limits=Limits(max_grpc_message_bytes=limit), metrics=None,
                               abort_requests=abort_requests)
    call = GenerateStreamCall(servicer, context=None, caller="me")
    split = responses_from_output(_output(40, 40), 2, limit - 200)
    ok = engine_pb2.RequestStatus(code=grpc.StatusCode.OK.value[0])
    entries = [engine_pb2.RequestDeltas(request_id="small", responses=responses_from_output(_output(1, 1), 1)),
               engine_pb2.RequestDeltas(request_id="split", responses=split, status=ok),
               engine_pb2.RequestDeltas(request_id="huge", responses=responses_from_output(_output(5, 1), 1)
                                        + responses_from_output(_output(40, 40), 2, None)),
               engine_pb2.RequestDeltas(request_id="after", responses=responses_from_output(_output(2, 1), 1))]
    messages = asyncio.run(call._messages(entries))
    assert len(messages) > len(split) and all(m.ByteSize() <= limit for m in messages)
    seen: dict[str, list] = {}
    for message in messages:
        ids = [entry.request_id for entry in message.requests]
        assert len(ids) == len(set(ids))
        for entry in message.requests:
            assert "status" not in seen.get(entry.request_id, [])  # nothing after a request's status
            seen.setdefault(entry.request_id, []).extend(entry.responses)
            if entry.HasField("status"):
                seen[entry.request_id].append("status")
    assert seen["split"] == list(split) + ["status"]
    assert seen["small"] == list(entries[0].responses) and seen["after"] == list(entries[3].responses)
    huge = [entry for message in messages for entry in message.requests if entry.request_id == "huge"]
    assert huge[-1].status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and aborted == ["huge"]


# ---- end to end -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(tiny_checkpoint):
    limits = Limits(max_logprobs=-1, max_grpc_message_bytes=MESSAGE_LIMIT)
    with tiny_llama_backend(tiny_checkpoint("llama"), limits) as running:
        yield running


PARAMS = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=VOCAB, logprobs=2)


def _request(request_id: str, accept_split: bool) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT, accept_split_prompt_logprobs=accept_split,
        sampling_params=engine_pb2.SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=VOCAB, logprobs=2))


def test_the_backend_splits_on_both_rpcs_and_the_client_joins_them(backend):
    engine, loop, server, limits = backend
    address = f"127.0.0.1:{server.port}"

    async def collect(client, request_id):
        return [output async for output in client.generate(request_id, PROMPT, PARAMS)]

    async def run():
        in_process = [o async for o in engine.generate("in-process", PROMPT, PARAMS)]
        multiplexed = GrpcEngineClient(address, limits)
        unary = GrpcEngineClient(address, limits, multiplexed=False)
        try:
            return in_process, await collect(multiplexed, "stream"), await collect(unary, "unary")
        finally:
            await multiplexed.close()
            await unary.close()

    in_process, streamed, unary = loop.run(run(), timeout=120)
    expected = in_process[0].prompt_logprobs
    assert len(expected) == len(PROMPT) and all(len(p) >= VOCAB for p in expected[1:])
    assert prompt_logprobs_bytes_bound(len(PROMPT), VOCAB, VOCAB) > 2 * MESSAGE_LIMIT
    for outputs in (streamed, unary):
        assert outputs[0].prompt_logprobs == expected  # the joined positions, every alternative
        assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in in_process]
        assert all(o.prompt_logprobs is None for o in outputs[1:])

    # The split happened: on Generate, several responses before the first token, each within the limit.
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", MESSAGE_LIMIT)]) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        responses = list(stub.Generate(_request("raw-unary", True), timeout=60))
        parts = [r for r in responses if r.prompt_logprobs_continued]
        assert len(parts) >= 2 and responses[:len(parts)] == parts
        assert all(r.ByteSize() <= MESSAGE_LIMIT for r in responses)

        # On GenerateStream: the parts of one request go over several messages.
        messages = list(stub.GenerateStream(iter([engine_pb2.GenerateStreamRequest(requests=[
            engine_pb2.StreamedGenerateRequest(request=_request("raw-stream", True))])]), timeout=60))
        assert len(messages) > 2 and all(m.ByteSize() <= MESSAGE_LIMIT for m in messages)
        entries = [e for m in messages for e in m.requests if e.request_id == "raw-stream"]
        assert entries[-1].status.code == grpc.StatusCode.OK.value[0]
        streamed_responses = [r for e in entries for r in e.responses]
        assert sum(r.prompt_logprobs_continued for r in streamed_responses) >= 2
        reader = OutputReader("raw-stream")
        joined = [o for o in map(reader.read, streamed_responses) if o is not None]
        assert joined[0].prompt_logprobs[1:] == [{t: Logprob(lp.logprob, rank=lp.rank) for t, lp in p.items()}
                                                 for p in expected[1:]]


def test_the_http_answer_holds_the_whole_vocabulary_at_every_prompt_position(backend):
    """/v1/completions with prompt_logprobs=-1 through a frontend over the 48 KiB-limited backend."""
    engine, loop, _, limits = backend

    async def in_process():
        return [o async for o in engine.generate("http-reference", PROMPT, PARAMS)][0].prompt_logprobs

    expected = loop.run(in_process(), timeout=60)
    with backend_and_frontend(loop, engine, limits) as (_, _, base_url):
        answer = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": -1})
    assert answer.status_code == 200, answer.text
    positions = answer.json()["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(PROMPT) and positions[0] is None
    for got, want in zip(positions[1:], expected[1:]):
        assert {int(t): (entry["logprob"], entry["rank"]) for t, entry in got.items()} == {
            t: (lp.logprob, lp.rank) for t, lp in want.items()}


def test_a_client_that_cannot_join_parts_is_refused_before_the_request_runs(backend, monkeypatch):
    engine, loop, server, _ = backend
    started = []  # request IDs the engine was given
    engine_generate = engine.generate

    def generate(request_id, *args, **kwargs):
        started.append(request_id)
        return engine_generate(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", generate)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(_request("no-split", False), timeout=60))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(error.value.trailing_metadata())["tandem-error-param"] == "prompt_logprobs"
        assert "accept_split_prompt_logprobs" in error.value.details()
        assert "--max-grpc-message-bytes" in error.value.details()
        # Fewer alternatives fit one message: served unsplit, as before.
        request = _request("fits", False)
        request.sampling_params.prompt_logprobs = 5
        responses = list(stub.Generate(request, timeout=60))
        assert not any(r.prompt_logprobs_continued for r in responses)
        assert len(responses[0].prompt_logprobs.positions) == len(PROMPT) - 1
    assert started == ["fits"]  # the refused request never reached the engine
