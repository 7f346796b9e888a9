"""The ``external_launcher`` executor: a launcher (``torchrun``) started one process per device,
and each runs a whole engine with its own rank's worker in-process.

    torchrun --nproc-per-node 2 my_script.py     # my_script: LLM(..., tensor_parallel_size=2,
                                                 #   distributed_executor_backend="external_launcher")

The rank comes from the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR/MASTER_PORT). Every copy must be given the same requests in the same order; then
every scheduler makes the same decisions. Each step checks that (a digest of the step, gathered
from all ranks: a mismatch is an error, not a hang or garbage) and hands every copy the output
rank's sampled tokens, so all copies produce identical outputs.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from backend.distributed import all_gather_object, broadcast_object, get_parallel_state, output_rank
from backend.executor.base import Executor
from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import SchedulerOutput
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError
from backend.worker.worker import Worker, cpu_share


def launcher_env(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise InvalidRequestError(
            f"The 'external_launcher' executor runs under a launcher such as torchrun, which sets "
            f"{name}; it is not set.", param="distributed_executor_backend")
    return int(value)


def step_digest(sched: SchedulerOutput) -> str:
    """What the step computes, identically on every rank that agrees."""
    parts = [(s.request_id, s.start_pos, s.num_tokens, s.needs_sample) for s in sched.scheduled]
    parts.append(sorted(sched.finished_request_ids))
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


class ExternalLauncherExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        world_size = launcher_env("WORLD_SIZE")
        if world_size != config.world_size:
            raise InvalidRequestError(
                f"The launcher started {world_size} processes, but tensor_parallel_size x "
                f"pipeline_parallel_size is {config.world_size}.", param="tensor_parallel_size")
        self.rank = launcher_env("RANK")
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        self.worker = Worker(config, self.rank, launcher_env("LOCAL_RANK"), "env://",
                             cpu_share(local_world_size))
        self.worker.load_model()
        self.output_rank = output_rank(config.tensor_parallel_size, config.pipeline_parallel_size)
        self.num_steps = 0

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return all_gather_object(getattr(self.worker, method)(*args), get_parallel_state())

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        state = get_parallel_state()
        digests = all_gather_object(step_digest(sched), state)
        if len(set(digests)) > 1:
            raise self._fail(
                f"The engine copies disagree on step {self.num_steps} (rank {self.rank}): every "
                "rank must be given the same requests in the same order.")
        self.num_steps += 1
        output = self.worker.execute_model(sched)
        return broadcast_object(output, self.output_rank, state)

    def shutdown(self) -> None:
        self.worker.shutdown()
