"""Generated-token logprobs larger than one gRPC message (e.g. logprobs over the whole vocabulary
with a large --stream-interval) are split over several GenerateResponses, each with whole tokens
and within the message limit; the frontend sees consecutive deltas holding every token once.

The wire side is checked on its own (``responses_from_output``), then end to end: the real backend
on a tiny random Llama (vocabulary 384) with --stream-interval 32 and the message limit lowered to
48 KiB, so one delta's logprobs over the whole vocabulary (~150 KB) must be split, on both RPCs.
"""

from __future__ import annotations

from typing import Optional

import grpc
import pytest
from helpers import tiny_llama_backend

from backend.server.proto_convert import responses_from_output
from backend.types.limits import Limits
from backend.types.outputs import EngineOutput, FinishReason, Logprob
from backend.types.sampling_params import SamplingParams
from frontend.grpc_client import GrpcEngineClient
from frontend.proto_convert import OutputReader
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.timeout(180)

VOCAB = 384  # conftest's tiny models
MESSAGE_LIMIT = 48 * 1024
INTERVAL = 32
PROMPT = [3, 4, 5, 6]


def _position(token: int, k: int) -> dict[int, Logprob]:
    position = {token: Logprob(-0.5, rank=3)}
    for j in range(k):
        position.setdefault((token + 1 + j) % VOCAB, Logprob(-1.0 - j / 8, rank=1 + j))  # exact in float32
    return position


def _output(num_tokens: int, k: Optional[int], **fields) -> EngineOutput:
    """A delta of ``num_tokens`` tokens, each with ``k`` alternatives (None: no logprobs)."""
    tokens = [(11 * i + 2) % VOCAB for i in range(num_tokens)]
    logprobs = None if k is None else [_position(t, k) for t in tokens]
    return EngineOutput("r", fields.pop("index", 0), tokens, logprobs, **fields)


def _joined(responses: list[engine_pb2.GenerateResponse]) -> list[EngineOutput]:
    reader = OutputReader("r")
    return [o for o in map(reader.read, responses) if o is not None]


# ---- the wire, on its own -----------------------------------------------------------------------


@pytest.mark.parametrize("max_bytes", [600, 3000, 10_000])
def test_a_token_split_is_whole_tokens_under_the_bound_with_the_end_last(max_bytes):
    output = _output(30, 40, finish_reason=FinishReason.STOP, stop_reason=7, num_prompt_tokens=9,
                     num_cached_tokens=4)
    (whole,) = responses_from_output(output, 45, None)
    assert whole.ByteSize() > max_bytes
    responses = responses_from_output(output, 45, max_bytes)
    assert len(responses) > 1 and all(r.ByteSize() <= max_bytes for r in responses)
    assert all(len(r.new_token_ids) == len(r.new_logprobs) > 0 for r in responses)
    assert [t for r in responses for t in r.new_token_ids] == list(whole.new_token_ids)
    assert [p for r in responses for p in r.new_logprobs] == list(whole.new_logprobs)
    # Running totals: the last part carries the step's total, as the unsplit response did.
    totals = [r.num_completion_tokens for r in responses]
    assert totals[-1] == 45 and totals == [45 - 30 + sum(len(r.new_token_ids) for r in responses[:i + 1])
                                           for i in range(len(responses))]
    *parts, last = responses
    assert all(p.finish_reason == engine_pb2.FINISH_REASON_UNSPECIFIED and not p.HasField("stop_token_id")
               for p in parts)
    assert last.finish_reason == engine_pb2.FINISH_REASON_STOP and last.stop_token_id == 7
    assert all((r.index, r.num_prompt_tokens, r.num_cached_tokens) == (0, 9, 4) for r in responses)


def test_a_delta_that_fits_is_one_response_and_a_single_token_is_never_cut():
    assert len(responses_from_output(_output(30, 2), 30, 100_000)) == 1
    assert len(responses_from_output(_output(30, None), 30, 300)) == 1  # no logprobs: tokens alone fit
    responses = responses_from_output(_output(3, 300), 3, 500)  # each token's logprobs exceed the bound
    assert [len(r.new_token_ids) for r in responses] == [1, 1, 1]


def test_prompt_logprobs_and_token_logprobs_split_together():
    output = _output(20, 40, num_prompt_tokens=31, num_cached_tokens=0)
    output.prompt_logprobs = [None] + [_position(t, 40) for t in range(30)]
    responses = responses_from_output(output, 20, 2000)
    assert all(r.ByteSize() <= 2000 for r in responses)
    continued = [r for r in responses if r.prompt_logprobs_continued]
    assert continued and responses[:len(continued)] == continued
    (joined_first, *rest) = _joined(responses)
    assert joined_first.prompt_logprobs == output.prompt_logprobs
    assert [t for o in (joined_first, *rest) for t in o.new_token_ids] == output.new_token_ids
    assert [p for o in (joined_first, *rest) for p in o.new_logprobs] == output.new_logprobs
    assert all(o.prompt_logprobs is None for o in rest)


def test_prompt_logprobs_a_client_cannot_join_stay_whole_beside_the_first_tokens():
    output = _output(20, 40, num_prompt_tokens=11, num_cached_tokens=0)
    output.prompt_logprobs = [None] + [_position(t, 5) for t in range(10)]
    responses = responses_from_output(output, 20, 3000, split_prompt_logprobs=False)
    assert len(responses) > 1 and not any(r.prompt_logprobs_continued for r in responses)
    assert all(r.ByteSize() <= 3000 for r in responses)
    assert len(responses[0].prompt_logprobs.positions) == 10 and responses[0].new_token_ids
    assert not any(r.HasField("prompt_logprobs") for r in responses[1:])


# ---- end to end -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(tiny_checkpoint):
    limits = Limits(max_logprobs=-1, max_grpc_message_bytes=MESSAGE_LIMIT)
    with tiny_llama_backend(tiny_checkpoint("llama"), limits, stream_interval=INTERVAL) as running:
        yield running


PARAMS = SamplingParams(temperature=0.0, max_tokens=INTERVAL + 8, logprobs=VOCAB, ignore_eos=True)


def test_the_backend_splits_token_logprobs_on_both_rpcs(backend):
    engine, loop, server, limits = backend
    address = f"127.0.0.1:{server.port}"

    async def run():
        in_process = [o async for o in engine.generate("in-process", PROMPT, PARAMS)]
        got = []
        for multiplexed in (True, False):
            client = GrpcEngineClient(address, limits, multiplexed=multiplexed)
            try:
                got.append([o async for o in client.generate(f"via-{multiplexed}", PROMPT, PARAMS)])
            finally:
                await client.close()
        return in_process, got

    in_process, got = loop.run(run(), timeout=120)
    assert max(len(o.new_token_ids) for o in in_process) == INTERVAL  # one delta of 32 tokens...
    assert sum(len(p) for p in in_process[1].new_logprobs) == INTERVAL * VOCAB  # ...too big for a message
    tokens = [t for o in in_process for t in o.new_token_ids]
    logprobs = [p for o in in_process for p in o.new_logprobs]
    for outputs in got:
        assert len(outputs) > len(in_process)  # the big delta came in parts
        assert [t for o in outputs for t in o.new_token_ids] == tokens
        assert [{t: (lp.logprob, lp.rank) for t, lp in p.items()} for o in outputs for p in o.new_logprobs] == [
            {t: (lp.logprob, lp.rank) for t, lp in p.items()} for p in logprobs]
        assert outputs[-1].finish_reason == FinishReason.LENGTH
        assert all(o.finish_reason is None for o in outputs[:-1])

    # On the wire: every message within the limit, on both RPCs.
    request = engine_pb2.GenerateRequest(request_id="raw", prompt_token_ids=PROMPT, sampling_params=(
        engine_pb2.SamplingParams(temperature=0.0, max_tokens=INTERVAL + 8, logprobs=VOCAB, ignore_eos=True)))
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", MESSAGE_LIMIT)]) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        responses = list(stub.Generate(request, timeout=60))
        assert len(responses) > len(in_process) and all(r.ByteSize() <= MESSAGE_LIMIT for r in responses)
        assert [r.num_completion_tokens for r in responses] == [
            sum(len(r.new_token_ids) for r in responses[:i + 1]) for i in range(len(responses))]
        request.request_id = "raw-stream"
        messages = list(stub.GenerateStream(iter([engine_pb2.GenerateStreamRequest(requests=[
            engine_pb2.StreamedGenerateRequest(request=request)])]), timeout=60))
        assert len(messages) > 2 and all(m.ByteSize() <= MESSAGE_LIMIT for m in messages)
        entries = [e for m in messages for e in m.requests]
        assert entries[-1].status.code == grpc.StatusCode.OK.value[0]
        assert [t for e in entries for r in e.responses for t in r.new_token_ids] == tokens
