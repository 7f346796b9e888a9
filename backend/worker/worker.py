"""A worker: one per device. Sets the device up, joins the TP/PP world, owns the model runner."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from typing import Optional

import torch

from tandem_kernels import ops as kernels
from backend.distributed import destroy_distributed, init_distributed
from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import SchedulerOutput
from backend.types.config import EngineConfig
from backend.types.startup_log import log_phase
from backend.worker.deferred_step import DeferredStep
from backend.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    """rank: global index among all workers (see distributed.py for the layout);
    local_rank: index on this machine, which picks the device.

    ``distributed_init_method`` (``file://``, ``tcp://host:port`` or ``env://``) is where the
    ranks meet; None for a world of one. ``num_threads``: torch threads on the CPU, when the
    machine's cores are shared with other workers (see ``cpu_share``).
    """

    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: Optional[str] = None,
                 num_threads: Optional[int] = None) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        if config.device_type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            tune_glibc_malloc()
            if num_threads is not None:
                torch.set_num_threads(num_threads)
        if distributed_init_method is not None:
            init_distributed(config.tensor_parallel_size, config.pipeline_parallel_size, rank,
                             distributed_init_method, self.device)
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.device)
        self._kv_sizing_seconds = 0.0  # determine_num_blocks' time, reported with the KV cache's

    # The start-up phases (backend/types/startup_log.py) are timed here, around the runner's calls;
    # rank 0 speaks for every worker.

    def load_model(self) -> None:
        if self.device.type == "cpu":
            kernels.cpu.available()  # built or loaded now, so its phase line is apart from the weights'
        start = time.monotonic()
        self.runner.load_model()
        if self.rank == 0:
            log_phase(logger, "weights", f"{self.config.model_path} on {self.device.type} in "
                      f"{self.config.torch_dtype_name}", time.monotonic() - start)

    def determine_num_blocks(self) -> int:
        start = time.monotonic()
        num_blocks = self.runner.determine_num_blocks()
        self._kv_sizing_seconds = time.monotonic() - start
        return num_blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        start = time.monotonic()
        self.runner.init_kv_cache(num_blocks)
        if self.rank == 0:  # the decode graphs captured in there log their own phase
            capture_seconds = getattr(self.runner.graphs, "capture_seconds", 0.0)
            cache_bytes = sum(t.numel() * t.element_size() for kv in self.runner.kv_caches for t in kv)
            log_phase(logger, "KV cache", f"{num_blocks} blocks of {self.config.block_size} tokens, "
                      f"{cache_bytes / 2**30:.2f} GiB, sized and allocated",
                      self._kv_sizing_seconds + time.monotonic() - start - capture_seconds)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)

    def launch(self, sched: SchedulerOutput, greedy: bool) -> DeferredStep:
        """A step that ``deferral`` allows: queued, its tokens read later by ``read``."""
        step = self.runner.launch(sched, defer=True, greedy=greedy)
        assert isinstance(step, DeferredStep)
        return step

    def read(self, step: DeferredStep) -> ModelRunnerOutput:
        return self.runner.read(step)

    def shutdown(self) -> None:
        destroy_distributed()


def cpu_share(local_world_size: int) -> Optional[int]:
    """Torch threads for each of ``local_world_size`` CPU workers on this machine (None: all)."""
    if local_world_size <= 1:
        return None
    return max(1, len(os.sched_getaffinity(0)) // local_world_size)


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
