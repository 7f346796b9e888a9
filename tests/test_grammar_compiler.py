"""Grammar compilation bounded in time and parallelism (backend/core/structured_output/compiler.py).

The slow spec is a JSON Schema of objects nested 400 deep (36 KB): xgrammar spends ~16 s of CPU
turning it into EBNF (measured; about cubic in the depth), whatever the vocabulary, so a
timeout of a few seconds always stops it and a quick spec always beats it.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import TINY_VOCAB

from backend.core.structured_output.compiler import GrammarCompiler
from backend.engine.async_llm_engine import AsyncLLMEngine
from backend.engine.llm_engine import LLMEngine
from backend.types.config import EngineConfig
from backend.types.errors import EngineDeadError, InvalidRequestError
from backend.types.outputs import FinishReason
from backend.types.sampling_params import SamplingParams, StructuredOutputsParams

TIMEOUT_S = 2.0


def nested_objects(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema, "b": {"type": "string"}}, "required": ["a", "b"]}
    return schema


SLOW = StructuredOutputsParams(json=nested_objects(400))


def assert_timed_out(error: InvalidRequestError) -> None:
    assert error.param == "structured_outputs"
    assert "structured_outputs.json" in error.message and "--grammar-compile-timeout-s" in error.message
    assert f"longer than {TIMEOUT_S:g} s" in error.message


def engine_config(tiny_checkpoint, **kwargs) -> EngineConfig:
    return EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=64, max_model_len=128,
                        grammar_compile_timeout_s=TIMEOUT_S, **kwargs)


@pytest.mark.timeout(300)
def test_a_grammar_past_its_timeout_is_a_400_while_other_requests_go_on(tiny_checkpoint):
    """The acceptance: the slow spec's 400 comes within the timeout + 1 s; an unconstrained request
    sent with it completes as it does alone; a quick constrained one is not held up by it."""
    engine = AsyncLLMEngine(engine_config(tiny_checkpoint, grammar_compile_workers=2))
    compiler = engine.engine.structured_output.compiler
    assert (compiler.timeout_s, compiler.num_workers) == (TIMEOUT_S, 2)  # the settings reach the engine
    compiler.start(wait=True)  # a worker's start is not the spec's time
    free = SamplingParams(temperature=0.0, max_tokens=8)
    quick = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs={"regex": "[0-9]{3}"})
    finished: list[str] = []

    async def tokens(request_id: str, params: SamplingParams) -> list[int]:
        out = [o async for o in engine.generate(request_id, [1, 2, 3], params)]
        finished.append(request_id)
        assert out[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        return [t for o in out for t in o.new_token_ids]

    async def slow() -> tuple[InvalidRequestError, float]:
        start = time.monotonic()
        with pytest.raises(InvalidRequestError) as error:
            await tokens("slow", SamplingParams(max_tokens=4, structured_outputs=SLOW))
        finished.append("slow")
        return error.value, time.monotonic() - start

    async def scenario():
        alone = await tokens("alone", free)
        finished.clear()
        together = await asyncio.gather(slow(), tokens("quick", quick), tokens("free", free))
        return alone, together

    try:
        alone, ((error, elapsed), quick_tokens, free_tokens) = asyncio.run(scenario())
        assert_timed_out(error)
        assert elapsed <= TIMEOUT_S + 1.0
        assert free_tokens == alone
        assert finished.index("quick") < finished.index("slow")  # compiled beside the slow one, not after it
        assert not engine.engine.has_unfinished_requests()
    finally:
        engine.shutdown()


@pytest.mark.timeout(300)
def test_the_synchronous_path_has_the_same_bound(tiny_checkpoint):
    """``LLMEngine.add_request`` without a compiled grammar (offline callers) compiles on its caller's
    thread, within the same timeout; the spec is refused before anything is queued."""
    engine = LLMEngine(engine_config(tiny_checkpoint, grammar_compile_workers=1))
    try:
        engine.structured_output.compiler.start(wait=True)
        start = time.monotonic()
        with pytest.raises(InvalidRequestError) as error:
            engine.add_request("slow", [1, 2, 3], SamplingParams(structured_outputs=SLOW))
        assert time.monotonic() - start <= TIMEOUT_S + 1.0
        assert_timed_out(error.value)
        assert not engine.has_unfinished_requests()
        # The stopped worker was replaced: the next spec compiles and is enforced.
        engine.add_request("next", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=10,
                                                             structured_outputs={"choice": ["yes", "no"]}))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def compiler(tiny_checkpoint):
    """One worker, so a slow spec holds the only one."""
    compiler = GrammarCompiler(str(tiny_checkpoint("llama")), TINY_VOCAB, [], timeout_s=TIMEOUT_S, num_workers=1)
    compiler.start(wait=True)
    yield compiler
    compiler.shutdown()


async def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


@pytest.mark.timeout(120)
def test_cached_specs_never_wait_and_equal_specs_compile_once(compiler):
    quick = StructuredOutputsParams(regex="[a-z]{2}")
    other = StructuredOutputsParams(choice=["one", "two"])
    compiled = compiler.compile(quick)

    async def scenario():
        before = compiler.num_worker_compiles
        slow = asyncio.create_task(compiler.compile_async(SLOW))
        await wait_for(lambda: compiler.num_worker_compiles == before + 1)  # the only worker is busy
        assert await compiler.compile_async(quick) is compiled and not slow.done()
        both = asyncio.gather(compiler.compile_async(other), compiler.compile_async(other))
        with pytest.raises(InvalidRequestError) as error:
            await slow
        assert_timed_out(error.value)
        first, second = await both
        assert first is second and compiler.num_worker_compiles == before + 2
        # Asked again, the slow spec is refused at once, without a worker.
        with pytest.raises(InvalidRequestError, match="grammar-compile-timeout-s"):
            await compiler.compile_async(SLOW)
        assert compiler.num_worker_compiles == before + 2

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_compile_nobody_waits_for_is_dropped_before_it_reaches_a_worker(compiler):
    slow = StructuredOutputsParams(json=nested_objects(399))  # not the remembered one
    dropped = StructuredOutputsParams(regex="[0-9]{5}")

    async def scenario():
        before = compiler.num_worker_compiles
        slow_task = asyncio.create_task(compiler.compile_async(slow))
        await wait_for(lambda: compiler.num_worker_compiles == before + 1)
        waiting = asyncio.create_task(compiler.compile_async(dropped))
        await asyncio.sleep(0.2)
        waiting.cancel()
        with pytest.raises(InvalidRequestError):
            await slow_task
        await compiler.compile_async(StructuredOutputsParams(regex="x"))  # the worker is free again
        assert compiler.num_worker_compiles == before + 2  # the dropped spec never reached it
        await compiler.compile_async(dropped)  # and it is not remembered as failed
        assert compiler.num_worker_compiles == before + 3

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_worker_killed_mid_compile_fails_only_that_spec(compiler):
    slow = StructuredOutputsParams(json=nested_objects(398))

    async def scenario():
        before = compiler.num_worker_compiles
        task = asyncio.create_task(compiler.compile_async(slow))
        await wait_for(lambda: compiler.num_worker_compiles == before + 1)
        (worker,) = compiler._workers
        worker.process.kill()
        with pytest.raises(InvalidRequestError, match="grammar compiler was killed by signal 9"):
            await task
        await compiler.compile_async(StructuredOutputsParams(regex="[xy]{3}"))  # a replacement compiles

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_shutdown_ends_every_worker(tiny_checkpoint):
    compiler = GrammarCompiler(str(tiny_checkpoint("llama")), TINY_VOCAB, [], timeout_s=TIMEOUT_S, num_workers=2)
    compiler.start(wait=True)
    processes = [worker.process for worker in compiler._workers]
    assert len(processes) == 2 and all(p.poll() is None for p in processes)
    compiler.shutdown()
    assert all(p.poll() is not None for p in processes)
    with pytest.raises(EngineDeadError):
        compiler.compile(StructuredOutputsParams(regex="a"))


def test_the_settings_are_validated_and_are_flags():
    for name, value in (("grammar_compile_timeout_s", 0), ("grammar_compile_timeout_s", float("nan")),
                        ("grammar_compile_workers", 0), ("grammar_compile_workers", 65)):
        with pytest.raises(InvalidRequestError) as error:
            EngineConfig(**{name: value})
        assert error.value.param == name
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(["--grammar-compile-timeout-s", "2.5",
                                                           "--grammar-compile-workers", "3"]))
    assert (config.grammar_compile_timeout_s, config.grammar_compile_workers) == (2.5, 3)

