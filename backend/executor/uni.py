"""One worker, in this process: the default for a single device."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from backend.executor.base import Executor
from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import SchedulerOutput
from backend.types.config import EngineConfig
from backend.worker.deferred_step import GREEDY, DeferredStep, deferral
from backend.worker.worker import Worker


class UniExecutor(Executor):
    """With async scheduling, steps run on one thread of their own, in launch order, while the
    engine's thread schedules the next and processes the last (torch releases the GIL).

    On CUDA a plain decode step (``deferral``) is launched and left on the device: its future
    is resolved once the next step has been queued behind it (or on ``flush``), so the device
    never waits for the host to read one step's tokens and prepare the next. Any other step
    first resolves the one left pending, then runs and resolves at once."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.load_model()
        self._step_thread: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[tuple[DeferredStep, Future]] = None  # only the step thread touches it
        # Deferring pays only where the device runs queued work by itself (CUDA); on the CPU a
        # step's kernels run inside the launch. Tests turn it on there to check its bookkeeping.
        self.defer_steps = self.worker.device.type == "cuda"

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def execute_model_async(self, sched: SchedulerOutput) -> Future:
        result: Future = Future()
        self._thread().submit(self._run_step, sched, result)
        return result

    def flush(self) -> None:
        """Resolve the step left pending on the device (nothing will be launched behind it)."""
        if self._step_thread is not None:
            self._step_thread.submit(self._read_pending)

    def _thread(self) -> ThreadPoolExecutor:
        if self._step_thread is None:
            device = self.worker.device  # a thread's current CUDA device starts at 0
            initializer = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
            self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-step",
                                                   initializer=initializer)
        return self._step_thread

    def _run_step(self, sched: SchedulerOutput, result: Future) -> None:  # on the step thread
        kind = deferral(sched) if self.defer_steps else None
        if kind is None:
            self._read_pending()
            _settle(result, lambda: self.worker.execute_model(sched))
            return
        try:
            step = self.worker.launch(sched, greedy=kind == GREEDY)
        except BaseException as error:  # noqa: BLE001 -- handed to the engine through the future
            self._read_pending()
            result.set_exception(error)
            return
        self._read_pending()  # the step before, while this one is queued behind it on the device
        self._pending = (step, result)

    def _read_pending(self) -> None:  # on the step thread
        if self._pending is not None:
            (step, result), self._pending = self._pending, None
            _settle(result, lambda: self.worker.read(step))

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.submit(self._read_pending)
            self._step_thread.shutdown(wait=True)
            self._step_thread = None


def _settle(result: Future, compute) -> None:
    try:
        result.set_result(compute())
    except BaseException as error:  # noqa: BLE001 -- handed to the engine through the future
        result.set_exception(error)
