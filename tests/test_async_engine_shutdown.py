"""AsyncLLMEngine.shutdown from a thread other than its loop's: the step task has ended before it
returns (so closing the loop next leaves no task pending), and the engine stops even when the loop
is no longer running."""

from __future__ import annotations

import asyncio

import pytest
from helpers import LoopThread

from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.types.config import EngineConfig
from backend.types.sampling_params import SamplingParams


async def first_tokens(engine: AsyncLLMEngine) -> list[int]:
    async for output in engine.generate("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2)):
        return output.new_token_ids
    return []


def engine_that_served(checkpoint) -> tuple[LoopThread, AsyncLLMEngine]:
    """A tiny fp32 AsyncLLMEngine on a loop thread of its own, after one request (its step task
    now waits for work on that loop)."""
    loop = LoopThread()
    engine = AsyncLLMEngine(EngineConfig(model=str(checkpoint), dtype="float32", num_kv_blocks=64, block_size=4,
                                         max_model_len=64, max_num_seqs=4))
    assert loop.run(first_tokens(engine))
    return loop, engine


@pytest.mark.timeout(120)
def test_shutdown_from_another_thread_ends_the_step_task_before_it_returns(tiny_checkpoint):
    loop, engine = engine_that_served(tiny_checkpoint("llama"))
    try:
        task = engine._task
        assert task is not None and not task.done()  # waiting for work on the loop
        engine.shutdown()
        assert task.done()
    finally:
        loop.close()


@pytest.mark.timeout(120)
def test_shutdown_after_the_loop_stopped_still_stops_the_engine(tiny_checkpoint):
    loop, engine = engine_that_served(tiny_checkpoint("llama"))
    try:
        loop.loop.call_soon_threadsafe(loop.loop.stop)
        loop.thread.join(5)
        task = engine._task
        engine.shutdown()  # returns: no wait on a loop that does not run
        assert engine._thread._shutdown and not task.done()
        loop.loop.run_until_complete(asyncio.wait([task]))  # the cancel it queued ends the task
        assert task.cancelled()
    finally:
        loop.loop.close()
