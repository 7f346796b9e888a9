"""AsyncLLMEngine: the in-process ``EngineClient``, an ``LLMEngine`` stepped by an asyncio loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Optional

from backend.engine.llm_engine import LLMEngine
from backend.types.config import EngineConfig
from backend.types.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from backend.types.limits import Limits
from backend.engine.stream_interval import DeltaCoalescer
from backend.types.outputs import EngineLoad, EngineOutput, ModelInfo
from backend.types.pooling import PoolingParams
from backend.types.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """The in-process ``EngineClient``: LLMEngine.step() in a background asyncio loop.

    Steps run on one engine thread (torch releases the GIL), so the event loop
    stays responsive. Adds and aborts are queued and applied between steps, on
    that thread, so the engine core is only ever touched by it.
    """

    def __init__(self, config: EngineConfig, limits: Optional[Limits] = None) -> None:
        # Every torch call of the engine, model loading included, runs on this one thread: a
        # second thread running torch ops gets an OpenMP team of its own, and two teams on a
        # few cores slow each other down (measured: 1.7x slower steps on 2 cores).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-engine")
        try:
            self.engine = self._thread.submit(LLMEngine, config, limits).result()
        except BaseException:
            self._thread.shutdown(wait=False)
            raise
        self._lock = threading.Lock()
        self._pending_adds: list[tuple] = []  # LLMEngine.add_request's arguments
        self._pending_aborts: list[str] = []
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None
        self._wakeup: Optional[asyncio.Event] = None
        self.dead_error: Optional[BaseException] = None
        self.dead = asyncio.Event()  # set (on the engine's loop) when a step fails
        # A worker can die between steps too: fail the streams as soon as the executor knows.
        self.engine.executor.add_failure_callback(self._on_executor_failure)

    # ---- EngineClient ----------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       deadline: Optional[float] = None,
                       cache_salt: Optional[str] = None) -> AsyncIterator[EngineOutput]:
        """``deadline``: ``time.monotonic()`` seconds after which the engine aborts the request
        (its sequences end with ABORT); ``cache_salt``: see ``LLMEngine.add_request``."""
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine stopped after an error: {self.dead_error}")
        if request_id in self._streams:
            raise InvalidRequestError(f"Request ID {request_id!r} is already in use.",
                                      param="request_id")
        self.engine.validate(prompt_token_ids, params)  # here, so bad input never reaches the engine thread
        self.engine.limits.check_cache_salt(cache_salt)
        arrival = time.monotonic()
        grammar = None
        if params.structured_outputs is not None:  # off the engine thread; errors before queueing
            grammar = await self.engine.structured_output.compile_async(params.structured_outputs)
            if request_id in self._streams:
                raise InvalidRequestError(f"Request ID {request_id!r} is already in use.",
                                          param="request_id")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        with self._lock:
            self._pending_adds.append((request_id, list(prompt_token_ids), params, arrival, grammar, deadline,
                                       cache_salt))
        self._ensure_loop()
        remaining = params.n
        interval = self.engine.config.stream_interval
        coalescer = DeltaCoalescer(interval) if interval > 1 else None
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:  # the request failed inside the engine; the rest goes on
                    raise RequestFailedError(item.error)
                if item.finished:
                    remaining -= 1
                if coalescer is not None:
                    item = coalescer.push(item)
                    if item is None:
                        continue
                yield item
        finally:
            del self._streams[request_id]
            if remaining:
                await self.abort(request_id)

    async def embed(self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams, *,
                    deadline: Optional[float] = None) -> list[float]:
        """The prompt's pooled final hidden state (fp32, ``pooling``'s way): the prompt runs through
        the scheduler like any other (chunked, batched), samples one throwaway greedy token, and
        frees its blocks. Raises as ``generate`` does."""
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        # Mean and CLS pooling need the first positions computed here: a salt of its own means no
        # prefix hit.
        salt = f"embed-{uuid.uuid4().hex}" if pooling.type in ("mean", "cls") else None
        async with contextlib.aclosing(self.generate(request_id, prompt_token_ids, params, deadline=deadline,
                                                     cache_salt=salt)) as outputs:
            async for output in outputs:
                if output.finished:
                    if output.pooled is None:  # aborted (its deadline) before its prompt was computed
                        raise RequestFailedError("The embedding request ended before its prompt was computed.")
                    return output.pooled
        raise RequestFailedError("The embedding request ended without output.")

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._pending_aborts.append(request_id)
        self._ensure_loop()

    async def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    async def get_load(self) -> EngineLoad:
        return self.engine.get_load()

    async def health(self) -> bool:
        return self.dead_error is None

    # ---- the loop --------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._wakeup = asyncio.Event()
            self._task = loop.create_task(self._run())
        self._wakeup.set()

    def _step(self) -> list[EngineOutput]:
        """On the engine thread: apply queued adds/aborts, then one step."""
        with self._lock:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
        errors = []
        for args in adds:
            try:
                self.engine.add_request(*args)
            except (InvalidRequestError, RequestFailedError) as e:  # that request's own fault
                errors.append((args[0], e))
        self.engine.abort_request(aborts)
        expired = self.engine.abort_expired()
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        return errors + expired + outputs

    def _has_work(self) -> bool:
        with self._lock:
            pending = bool(self._pending_adds or self._pending_aborts)
        return pending or self.engine.has_unfinished_requests()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._has_work():
                self._wakeup.clear()
                if not self._has_work():
                    await self._wakeup.wait()
                continue
            try:
                results = await loop.run_in_executor(self._thread, self._step)
            except Exception as e:  # the engine is broken: fail every stream, refuse new ones
                logger.exception("Engine step failed")
                self._die(e)
                return
            for item in results:
                if isinstance(item, tuple):
                    request_id, error = item
                    queue = self._streams.get(request_id)
                    if queue is not None:
                        queue.put_nowait(error)
                    continue
                queue = self._streams.get(item.request_id)
                if queue is not None:
                    queue.put_nowait(item)

    def _die(self, error: BaseException) -> None:
        """On the event loop: refuse new requests and end every open stream with ``error``."""
        if self.dead_error is None:
            self.dead_error = error
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError(f"The engine stopped after an error: {self.dead_error}"))
        self.dead.set()

    def _on_executor_failure(self, error: BaseException) -> None:
        """From an executor thread: a worker died."""
        if self.dead_error is None:
            self.dead_error = error
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._die, error)
            except RuntimeError:  # the loop closed meanwhile: nothing left to tell
                pass

    def shutdown(self) -> None:
        """Cancel the step task and stop the engine. From a thread other than the task's loop, while
        that loop runs, waits (up to 5 s) for the task to end, so a loop closed next leaves no task
        pending. The engine thread and the engine are stopped whatever happens to the wait."""
        task, loop = self._task, self._loop
        try:
            if task is not None and not task.done() and loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)
                if loop.is_running() and not _running_on(loop):
                    asyncio.run_coroutine_threadsafe(asyncio.wait([task]), loop).result(timeout=5)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError):
            pass  # the loop stopped, closed or is stuck: nothing more to wait for
        finally:
            self._thread.shutdown(wait=True)
            self.engine.shutdown()


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    """True when the calling thread is running ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
