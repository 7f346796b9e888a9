"""--stream-interval: a served sequence's deltas regrouped to N tokens each (its first token at once,
its end with whatever is left), carrying exactly the tokens, logprobs and ends of the stream
without it."""

from __future__ import annotations

import asyncio

import pytest

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.engine.stream_interval import DeltaCoalescer
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.outputs import EngineOutput, FinishReason, Logprob
from backend.types.sampling_params import SamplingParams


def delta(token: int, index: int = 0, **kwargs) -> EngineOutput:
    return EngineOutput(request_id="r", index=index, new_token_ids=[token],
                        new_logprobs=[{token: Logprob(-float(token))}], num_prompt_tokens=3, **kwargs)


def regroup(interval: int, outputs: list[EngineOutput]) -> list[EngineOutput]:
    coalescer = DeltaCoalescer(interval)
    return [out for out in map(coalescer.push, outputs) if out is not None]


def test_first_token_at_once_then_groups_then_the_rest_with_the_end():
    outputs = [delta(t) for t in range(1, 10)] + [delta(10, finish_reason=FinishReason.LENGTH)]
    outputs[0].prompt_logprobs = [None, {7: Logprob(-1.0)}]
    sent = regroup(4, outputs)
    assert [out.new_token_ids for out in sent] == [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10]]
    assert [list(p)[0] for out in sent for p in out.new_logprobs] == list(range(1, 11))
    assert sent[0].prompt_logprobs == [None, {7: Logprob(-1.0)}]
    assert [out.finish_reason for out in sent] == [None, None, None, FinishReason.LENGTH]


def test_an_end_flushes_what_is_held_and_sequences_are_apart():
    outputs = [delta(1, 0), delta(1, 1), delta(2, 0), delta(2, 1), delta(3, 1),
               delta(3, 0, finish_reason=FinishReason.STOP, stop_reason=3),
               delta(4, 1, finish_reason=FinishReason.LENGTH)]
    sent = regroup(8, outputs)
    assert [(out.index, out.new_token_ids, out.finish_reason) for out in sent] == [
        (0, [1], None), (1, [1], None), (0, [2, 3], FinishReason.STOP), (1, [2, 3, 4], FinishReason.LENGTH)]
    assert sent[2].stop_reason == 3
    # An abort with no tokens ends a sequence whose tokens are held: they go out with it.
    sent = regroup(8, [delta(1), delta(2), EngineOutput("r", 0, [], finish_reason=FinishReason.ABORT)])
    assert [(out.new_token_ids, out.finish_reason) for out in sent] == [([1], None), ([2], FinishReason.ABORT)]


def test_interval_one_changes_nothing_and_bounds_are_checked():
    outputs = [delta(t) for t in range(1, 5)]
    assert regroup(1, outputs) == outputs
    for bad in (0, 1025):
        with pytest.raises(ValueError):
            DeltaCoalescer(bad)
        with pytest.raises(InvalidRequestError, match="stream_interval"):
            EngineConfig(stream_interval=bad)


@pytest.mark.parametrize("logprobs", [None, 2])
def test_served_stream_regrouped_equals_the_plain_stream(tiny_checkpoint, logprobs):
    """The engine's streams with --stream-interval 5: deltas of 1, then 5s, then the rest, and the
    same tokens and logprobs as with 1, for n = 2 sequences side by side."""
    model = tiny_checkpoint("llama")
    params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=13, logprobs=logprobs)

    def run(interval: int) -> list[EngineOutput]:
        engine = AsyncLLMEngine(EngineConfig(model=str(model), dtype="float32", block_size=4, num_kv_blocks=64,
                                             max_model_len=64, stream_interval=interval))

        async def collect():
            return [out async for out in engine.generate("a", [3, 4, 5, 6], params)]

        try:
            return asyncio.run(collect())
        finally:
            engine.shutdown()

    plain, grouped = run(1), run(5)
    for index in (0, 1):
        mine = [out for out in grouped if out.index == index]
        theirs = [out for out in plain if out.index == index]
        assert [len(out.new_token_ids) for out in mine] == [1, 5, 5, 2]
        assert [t for out in mine for t in out.new_token_ids] == [t for out in theirs for t in out.new_token_ids]
        assert mine[-1].finish_reason == theirs[-1].finish_reason == FinishReason.LENGTH
        if logprobs:
            assert [p for out in mine for p in out.new_logprobs] == [p for out in theirs for p in out.new_logprobs]


def test_through_grpc_and_the_frontend_fewer_events_same_text(tiny_checkpoint):
    """Served with --stream-interval 4, a streamed completion of 10 tokens arrives in at most 4
    events (1 + 4 + 4 + 1), with the text, logprobs and usage of the unstreamed request."""
    import json

    import httpx
    from helpers import LoopThread, backend_and_frontend

    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4,
                                         num_kv_blocks=64, max_model_len=64, stream_interval=4))
    loop = LoopThread()
    body = {"prompt": "hello there", "max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "logprobs": 1}
    try:
        with backend_and_frontend(loop, engine) as (_, _, base_url):
            whole = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
            streamed = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
                **body, "stream": True, "stream_options": {"include_usage": True}})
    finally:
        engine.shutdown()
        loop.close()
    events = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [event["choices"][0] for event in events if event["choices"]]
    assert 2 <= len(choices) <= 4, choices
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"] and len(tokens) == 10
    assert events[-1]["usage"]["completion_tokens"] == 10
