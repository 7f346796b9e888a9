"""One worker, in this process: the default for a single device."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any, Callable, Optional

import torch

from backend.executor.base import Executor
from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import SchedulerOutput
from backend.types.config import EngineConfig
from backend.worker.deferred_step import GREEDY, deferral
from backend.worker.worker import Worker


class UniExecutor(Executor):
    """With async scheduling, a step that ``deferral`` allows (a plain decode step) is launched
    on the caller's (the engine's) thread where the device runs queued work by itself (CUDA):
    its kernels are queued behind the step before and its tokens are read only when the engine
    asks for its result, after it has launched the next. One thread does all of a step's host
    work, as in sync mode, and the device never waits for the host to read one step and prepare
    the next. Any other step runs on a thread of its own, after the one left pending has been
    read, while the engine's thread processes the step before (torch releases the GIL; the
    runner waits there for a late grammar mask). Steps run in launch order: an inline launch
    first waits for the thread's last step. On the CPU (``defer_steps`` off) every step goes to
    the thread."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.load_model()
        self._step_thread: Optional[ThreadPoolExecutor] = None
        self._on_thread: Optional[Future] = None  # the last step handed to the thread
        self._pending: Optional[_ReadOnResult] = None  # the last step launched inline, until read
        # Deferring pays only where the device runs queued work by itself (CUDA); on the CPU a
        # step's kernels run inside the launch. Tests turn it on there to check its bookkeeping.
        self.defer_steps = self.worker.device.type == "cuda"

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def execute_model_async(self, sched: SchedulerOutput) -> Future:
        kind = deferral(sched) if self.defer_steps else None
        if kind is not None:
            return self._launch_inline(sched, greedy=kind == GREEDY)
        self._read_pending()  # its tokens feed this step's inputs on the host
        result: Future = Future()
        self._on_thread = result
        self._thread().submit(_settle, result, lambda: self.worker.execute_model(sched))
        return result

    def _launch_inline(self, sched: SchedulerOutput, greedy: bool) -> Future:
        if self._on_thread is not None:  # steps run in launch order: the thread's goes first
            wait_for([self._on_thread])
            self._on_thread = None
        try:
            step = self.worker.launch(sched, greedy=greedy)
        except BaseException as error:  # noqa: BLE001 -- handed to the engine through the future
            failed: Future = Future()
            failed.set_exception(error)
            return failed
        self._pending = _ReadOnResult(lambda: self.worker.read(step))
        return self._pending

    def _read_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.resolve()

    def _thread(self) -> ThreadPoolExecutor:
        if self._step_thread is None:
            device = self.worker.device  # a thread's current CUDA device starts at 0
            initializer = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
            self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-step",
                                                   initializer=initializer)
        return self._step_thread

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None
        self._read_pending()


class _ReadOnResult(Future):
    """A deferred step's future: its tokens are read (waiting for the device) on the thread
    that first asks for its result or exception, or by the executor before it hands a step to
    the step thread. Until then it is not done; it cannot be cancelled."""

    def __init__(self, read: Callable[[], ModelRunnerOutput]) -> None:
        super().__init__()
        self._read: Optional[Callable[[], ModelRunnerOutput]] = read
        self._reading = threading.Lock()

    def resolve(self) -> None:
        with self._reading:
            read, self._read = self._read, None
            if read is not None:
                _settle(self, read)

    def result(self, timeout: Optional[float] = None) -> ModelRunnerOutput:
        self.resolve()
        return super().result(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        self.resolve()
        return super().exception(timeout)

    def cancel(self) -> bool:
        return False


def _settle(result: Future, compute: Callable[[], ModelRunnerOutput]) -> None:
    try:
        result.set_result(compute())
    except BaseException as error:  # noqa: BLE001 -- handed to the engine through the future
        result.set_exception(error)
