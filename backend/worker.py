"""A worker: one per device. Sets the device up and owns that device's model runner."""

from __future__ import annotations

import ctypes
import sys

import torch

from backend.config import EngineConfig
from backend.model_runner import ModelRunner, ModelRunnerOutput
from backend.scheduler import SchedulerOutput


class Worker:
    """rank: global index among all workers; local_rank: device index on this machine."""

    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        if config.device_type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            tune_glibc_malloc()
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.device)

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)


def tune_glibc_malloc() -> None:
    """Make glibc keep large freed buffers instead of handing them back to the OS.

    Each CPU step allocates and frees many multi-MB tensors (gathered KV,
    activations). With glibc's defaults every one of them is mmap'ed and
    unmapped again, and all its pages fault in anew; raising the mmap and trim
    thresholds lets them reuse heap memory (what tcmalloc or jemalloc would do).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest allowed value
    libc.mallopt(m_trim_threshold, 1 << 30)
