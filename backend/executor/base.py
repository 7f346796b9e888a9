"""The executor interface: what the engine asks of its workers, whatever their number."""

from __future__ import annotations

from abc import ABC, abstractmethod

from backend.config import EngineConfig
from backend.errors import InvalidRequestError
from backend.model_runner import ModelRunnerOutput
from backend.scheduler import SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks that fit on every worker (the minimum over workers)."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None:
        ...

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; returns the driver worker's output."""

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig) -> Executor:
    backend = config.executor_backend
    if backend == "uni" and config.world_size == 1:
        from backend.executor.uni import UniExecutor

        return UniExecutor(config)
    raise InvalidRequestError(
        f"Executor {backend!r} with {config.world_size} worker(s) is not available in this "
        "version; use tensor_parallel_size=1 and the 'uni' executor.",
        param="distributed_executor_backend")
