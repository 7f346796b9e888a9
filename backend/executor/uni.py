"""One worker, in this process: the default for a single device."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from backend.executor.base import Executor
from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import SchedulerOutput
from backend.types.config import EngineConfig
from backend.worker.worker import Worker


class UniExecutor(Executor):
    """With async scheduling, steps run on one thread of their own, in launch order, while the
    engine's thread schedules the next and processes the last (torch releases the GIL)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.load_model()
        self._step_thread: Optional[ThreadPoolExecutor] = None

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def execute_model_async(self, sched: SchedulerOutput) -> Future:
        if self._step_thread is None:
            device = self.worker.device  # a thread's current CUDA device starts at 0
            initializer = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
            self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-step",
                                                   initializer=initializer)
        return self._step_thread.submit(self.worker.execute_model, sched)

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None
