"""The executor interface: what the engine asks of its workers, whatever their number and place.

The engine calls, in order: ``determine_num_blocks`` (the minimum over the workers, so every rank
fits the same cache), ``init_kv_cache``, then ``execute_model`` once per step (every worker runs its
part of the model; the output rank's sampled tokens come back), and ``shutdown`` once, which leaves
no worker process behind. A worker that dies is reported to ``add_failure_callback`` listeners as
soon as it is noticed (also between steps) and makes the next call raise ``WorkerDiedError``.

    uni                one worker in this process (one device)
    mp                 one worker process per device on this machine
    ray                one Ray actor per device, in a placement group, across machines
    external_launcher  torchrun (or similar) started the processes; each runs this engine
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Callable, Optional

from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import SchedulerOutput
from backend.types.config import EngineConfig
from backend.types.errors import WorkerDiedError

logger = logging.getLogger(__name__)


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.failure: Optional[WorkerDiedError] = None
        self._failure_callbacks: list[Callable[[WorkerDiedError], None]] = []
        self._failure_lock = threading.Lock()

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on every worker; their results in rank order."""

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; returns the output rank's output."""

    def execute_model_async(self, sched: SchedulerOutput) -> Future:
        """Launch one step; its ``ModelRunnerOutput`` comes in the future. Steps run in the order
        launched. Here the step runs before this returns; executors that overlap override it. The
        future may complete only once its ``result()`` (or ``exception()``) is asked for: callers
        wait on it that way, not with callbacks or ``concurrent.futures.wait``."""
        future: Future = Future()
        try:
            future.set_result(self.execute_model(sched))
        except BaseException as error:  # noqa: BLE001 -- handed to whoever waits on the step
            future.set_exception(error)
        return future

    def determine_num_blocks(self) -> int:
        """KV blocks that fit on every worker (the minimum over workers)."""
        return min(self.collective_rpc("determine_num_blocks"))

    def init_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("init_kv_cache", num_blocks)

    def shutdown(self) -> None:
        pass

    # ---- faults --------------------------------------------------------------------------

    def add_failure_callback(self, callback: Callable[[WorkerDiedError], None]) -> None:
        """``callback(error)`` runs once, on whichever thread notices a worker's death."""
        with self._failure_lock:
            failure = self.failure
            if failure is None:
                self._failure_callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def _fail(self, message: str) -> WorkerDiedError:
        """Record the first failure and tell the listeners; later ones keep the first."""
        with self._failure_lock:
            if self.failure is not None:
                return self.failure
            self.failure = WorkerDiedError(message)
            callbacks, self._failure_callbacks = self._failure_callbacks, []
        logger.error("%s", message)
        for callback in callbacks:
            try:
                callback(self.failure)
            except Exception:  # a listener's bug must not hide the failure from the others
                logger.exception("Executor failure callback raised")
        return self.failure

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise self.failure
