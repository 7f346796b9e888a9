"""One worker, in this process: the default for a single device."""

from __future__ import annotations

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

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)
