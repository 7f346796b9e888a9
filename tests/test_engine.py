"""LLMEngine and AsyncLLMEngine: aborts free every block, streams end cleanly."""

from __future__ import annotations

import asyncio
import time

import pytest

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.engine.llm_engine import LLMEngine
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.types.limits import Limits
from backend.types.outputs import FinishReason
from backend.types.sampling_params import SamplingParams


def config(model_dir, **kwargs) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128,
                        max_model_len=256, **kwargs)


def test_abort_mid_generation_frees_every_block(tiny_checkpoint):
    engine = LLMEngine(config(tiny_checkpoint("llama"), max_num_seqs=3))
    params = SamplingParams(temperature=0.0, max_tokens=50)
    for i in range(5):  # 3 run, 2 wait
        engine.add_request(f"r{i}", list(range(10 + i, 30 + i)), params)
    engine.add_request("n", list(range(5, 15)), SamplingParams(n=3, temperature=1.0, max_tokens=50))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.scheduler.num_waiting > 0
    engine.abort_request(["r0", "r3", "n", "unknown-id"])
    assert not {"r0", "r3", "n"} & {r.parent_id for r in engine.scheduler.requests.values()}
    engine.abort_request(["r1", "r2", "r4"])
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # Aborted IDs can be used again.
    engine.add_request("r0", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    outs = [o for _ in range(3) for o in engine.step()]
    assert [o.finish_reason for o in outs][-1] == FinishReason.LENGTH


def test_n_sequences_stream_with_their_index(tiny_checkpoint):
    engine = LLMEngine(config(tiny_checkpoint("llama")))
    engine.add_request("a", [1, 2, 3, 4], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("a", [1, 2], SamplingParams())
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "a"
            if out.finished:
                finished[out.index] = out.finish_reason
    assert finished == {0: FinishReason.LENGTH, 1: FinishReason.LENGTH, 2: FinishReason.LENGTH}


def test_async_engine_closing_a_stream_aborts_it(tiny_checkpoint):
    engine = AsyncLLMEngine(config(tiny_checkpoint("llama")))

    async def scenario():
        stream = engine.generate("a", list(range(20)), SamplingParams(temperature=0.0, max_tokens=200))
        got = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()  # the client went away
        with pytest.raises(InvalidRequestError, match="empty"):
            async for _ in engine.generate("b", [], SamplingParams()):
                pass
        done = [o async for o in engine.generate("c", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))]
        for _ in range(100):  # the abort is applied by the engine loop
            load = await engine.get_load()
            if load.num_requests_running == 0 and load.kv_cache_usage == 0.0:
                break
            await asyncio.sleep(0.02)
        return got, done, load

    got, done, load = asyncio.run(scenario())
    assert len(got) == 3 and not got[-1].finished
    assert done[-1].finish_reason == FinishReason.LENGTH and sum(len(o.new_token_ids) for o in done) == 3
    assert (load.num_requests_running, load.num_requests_waiting, load.kv_cache_usage) == (0, 0, 0.0)
    engine.shutdown()


def test_a_passed_deadline_aborts_the_request_and_frees_its_blocks(tiny_checkpoint):
    engine = LLMEngine(config(tiny_checkpoint("llama"), max_num_seqs=1))
    now = time.monotonic()
    engine.add_request("running", list(range(10, 30)), SamplingParams(max_tokens=50), deadline=now + 60)
    engine.add_request("waiting", list(range(40, 60)), SamplingParams(n=2, max_tokens=50), deadline=now + 0.05)
    engine.add_request("no-deadline", [1, 2, 3], SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.abort_expired(now) == []  # nothing has expired yet
    assert len(engine.sequence_ids("waiting")) == 2

    expired = engine.abort_expired(now + 0.1)
    assert sorted((o.request_id, o.index, o.finish_reason) for o in expired) == \
        [("waiting", 0, FinishReason.ABORT), ("waiting", 1, FinishReason.ABORT)]
    assert all(not o.new_token_ids for o in expired)
    assert {r.parent_id for r in engine.scheduler.requests.values()} == {"running", "no-deadline"}
    engine.abort_request(["running", "no-deadline"])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_reused_request_id_keeps_its_own_deadline(tiny_checkpoint):
    engine = LLMEngine(config(tiny_checkpoint("llama")))
    now = time.monotonic()
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=1), deadline=now + 1)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("r", [4, 5, 6], SamplingParams(max_tokens=50), deadline=now + 100)
    assert engine.abort_expired(now + 2) == []  # the first request's deadline is not the second's
    assert engine.sequence_ids("r")


def test_sampling_limits_are_checked_before_queueing(tiny_checkpoint):
    engine = LLMEngine(config(tiny_checkpoint("llama")), Limits(max_n=4, max_logprobs=3))
    with pytest.raises(InvalidRequestError, match="--max-n") as error:
        engine.add_request("big-n", [1, 2], SamplingParams(n=5))
    assert error.value.param == "n"
    with pytest.raises(InvalidRequestError, match="--max-logprobs"):
        engine.add_request("lp", [1, 2], SamplingParams(logprobs=4))
    assert not engine.has_unfinished_requests() and not engine.children
