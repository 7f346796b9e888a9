"""One worker, in this process: the default for a single device."""

from __future__ import annotations

from typing import Any

from backend.config import EngineConfig
from backend.executor.base import Executor
from backend.model_runner import ModelRunnerOutput
from backend.scheduler import SchedulerOutput
from backend.worker import Worker


class UniExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.load_model()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)
