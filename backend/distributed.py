"""Process groups for tensor and pipeline parallelism, and the collectives the models use.

One worker process per device. Ranks are laid out tensor-parallel innermost::

    rank = pp_rank * tp_size + tp_rank          e.g. TP=2 x PP=2:
                                                stage 0: ranks 0 1   (embedding, first layers)
                                                stage 1: ranks 2 3   (last layers, norm, LM head)

The output rank, whose sampled tokens go back to the engine, is the last stage's TP rank 0.
Communication: NCCL on CUDA, gloo on the CPU; objects (not tensors) always travel over gloo.
A process that never calls ``init_distributed`` is a world of one: every collective here is
then a no-op, so the single-device path pays nothing for this module.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

# A collective that waits this long has a peer that is gone or stuck: fail instead of hanging.
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    tp_group: Any = None  # this rank's stage: the ranks that all-reduce together
    cpu_group: Any = None  # all ranks, gloo: for Python objects

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        return self.rank == output_rank(self.tp_size, self.pp_size)

    @property
    def tp_root(self) -> int:
        """Global rank of TP rank 0 of this rank's stage."""
        return self.pp_rank * self.tp_size


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    """This process's place in the world (a world of one unless ``init_distributed`` ran)."""
    return _STATE


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank whose ``ModelRunnerOutput`` (sampled tokens) the engine uses."""
    return (pp_size - 1) * tp_size


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The [start, end) decoder layers of pipeline stage ``pp_rank``: as even as possible,
    earlier stages taking one fewer (they also hold the embedding)."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) is larger than the model's "
                         f"{num_layers} layers.")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + max(0, pp_rank - (pp_size - extra))
    return start, start + base + (1 if pp_rank >= pp_size - extra else 0)


def init_distributed(tp_size: int, pp_size: int, rank: int, init_method: str,
                     device: torch.device, timeout_s: Optional[float] = None) -> ParallelState:
    """Join the world (every rank calls this with the same sizes) and build the groups."""
    global _STATE
    timeout_s = timeout_s or float(os.environ.get("TANDEM_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=timeout_s)
    world_size = tp_size * pp_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                            timeout=timeout)
    # Every rank creates every group, in the same order (torch.distributed's rule).
    tp_group = None
    for stage in range(pp_size):
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)), timeout=timeout)
        if stage == rank // tp_size:
            tp_group = group
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    _STATE = ParallelState(rank=rank, tp_size=tp_size, pp_size=pp_size, tp_group=tp_group,
                           cpu_group=cpu_group)
    return _STATE


def destroy_distributed() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = ParallelState()


# ---- collectives -------------------------------------------------------------------------------


def tp_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum ``x`` over the stage's TP ranks, in place."""
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.tp_group)
    return x


def tp_gather(x: torch.Tensor, state: ParallelState) -> Optional[torch.Tensor]:
    """[rows, n] on every TP rank -> [rows, n * tp_size] on TP rank 0 (None on the others)."""
    if state.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)] if state.tp_rank == 0 else None
    dist.gather(x, parts, dst=state.tp_root, group=state.tp_group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def pp_send(tensors: dict[str, torch.Tensor], state: ParallelState) -> None:
    """Hand this stage's activations to the same TP rank of the next stage."""
    dst = state.rank + state.tp_size
    for name in sorted(tensors):
        dist.send(tensors[name].contiguous(), dst=dst)


def pp_recv(names: tuple[str, ...], shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device, state: ParallelState) -> dict[str, torch.Tensor]:
    """Receive what ``pp_send`` of the previous stage sent (same names, each of ``shape``)."""
    src = state.rank - state.tp_size
    out = {}
    for name in sorted(names):
        out[name] = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out[name], src=src)
    return out


def broadcast_object(obj: Any, src: int, state: ParallelState) -> Any:
    """``obj`` from rank ``src`` on every rank (pickled over the gloo group)."""
    if state.world_size == 1:
        return obj
    box = [obj if state.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=state.cpu_group)
    return box[0]


def all_gather_object(obj: Any, state: ParallelState) -> list[Any]:
    if state.world_size == 1:
        return [obj]
    out: list[Any] = [None] * state.world_size
    dist.all_gather_object(out, obj, group=state.cpu_group)
    return out
