"""The linear layers of every model: one base class, one place that multiplies, split over TP ranks.

Each layer holds its tensor-parallel rank's shard of the weight ([out, in], as nn.Linear)::

    ReplicatedLinear            the whole weight on every rank
    ColumnParallelLinear        output features split:  y_r = x @ W_r.T + b_r     (no communication)
    MergedColumnParallelLinear  several column-parallel linears with one input (gate | up), each split
    QKVParallelLinear           q | k | v, split by whole KV-head groups; KV heads replicated when
                                there are fewer of them than ranks
    RowParallelLinear           input features split:   y = all_reduce(x_r @ W_r.T) + b

A column-parallel layer feeds a row-parallel one (attention: QKV -> o_proj, MLP: gate_up -> down),
so each block costs one all-reduce. The matmul happens in exactly one place,
``layer.linear_method.apply(layer, x, bias)``: swap the method (prepacked weights, weight-only
int8, ...) and every linear of every model follows. With one rank ``forward`` is that single
call, so the TP=1 path costs nothing over ``nn.Linear``. An MLP's gate | up layer also offers
``forward_gated`` (SiLU(gate) * up), through the method's ``apply_gated``: ``apply`` and the SiLU
by default, one fused kernel where the method has one (AMX).

Checkpoint tensors arrive whole (as views of the memory-mapped file, see loader.py) and each
layer's ``weight_loader(param, tensor, shard_id)`` copies this rank's slice, so a rank reads only
its shard. Fused layers list the shards that must all be loaded in ``shard_ids``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tandem_kernels import ops as kernels
from backend.distributed import ParallelState, get_parallel_state, tp_all_reduce


class LinearMethod:
    """How a linear layer stores its weight and computes ``x @ W.T + b``. Subclass to change it."""

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Called once per layer after the checkpoint is loaded (e.g. to repack the weight)."""

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x: [num_tokens, in_local] -> [num_tokens, out_local]."""
        return F.linear(x, layer.weight, bias)

    def apply_gated(self, layer: "MergedColumnParallelLinear", x: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
        """A gate | up layer's SiLU(gate) * up: x [num_tokens, in] -> [num_tokens, out_local / 2].
        A method may fuse the activation into its matmul; the result is this one's, bit for bit."""
        return kernels.silu_and_mul(self.apply(layer, x, bias))


DEFAULT_LINEAR_METHOD = LinearMethod()


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} where {tuple(param.shape)} was expected")
    param.data.copy_(loaded)


def even_shard(size: int, state: ParallelState, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal share of ``size``."""
    if size % state.tp_size:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({state.tp_size}).")
    length = size // state.tp_size
    return state.tp_rank * length, length


class LinearBase(nn.Module):
    """weight: [output_size, input_size] of this rank; bias: [output_size] or None."""

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 linear_method: Optional[LinearMethod] = None) -> None:
        super().__init__()
        self.parallel = get_parallel_state()
        self.input_size = input_size
        self.output_size = output_size
        self.linear_method = linear_method or DEFAULT_LINEAR_METHOD
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split evenly over the TP ranks; the output stays split."""

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 linear_method: Optional[LinearMethod] = None) -> None:
        state = get_parallel_state()
        self.out_start, local = even_shard(output_size, state, "output size")
        super().__init__(input_size, local, bias, linear_method)

    def weight_loader(self, param, loaded, shard_id=None):
        default_weight_loader(param, loaded.narrow(0, self.out_start, param.shape[0]))


class MergedColumnParallelLinear(LinearBase):
    """Linears with one input fused into one matmul (gate | up); each part split over the ranks.

    Local layout: [part 0 of this rank | part 1 of this rank | ...]. The checkpoint stores the
    parts apart: shard i is part i.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 linear_method: Optional[LinearMethod] = None) -> None:
        state = get_parallel_state()
        shards = [even_shard(size, state, "output size") for size in output_sizes]
        self.part_starts = [start for start, _ in shards]  # in the full part
        self.part_sizes = [length for _, length in shards]  # local
        self.part_offsets = [sum(self.part_sizes[:i]) for i in range(len(shards))]  # local
        super().__init__(input_size, sum(self.part_sizes), bias, linear_method)
        self.shard_ids = tuple(range(len(output_sizes)))

    @property
    def gated_half(self) -> Optional[int]:
        """Local features of each part when the layer is a gate | up pair of equal parts, else None."""
        sizes = self.part_sizes
        return sizes[0] if len(sizes) == 2 and sizes[0] == sizes[1] else None

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of this rank's parts (a gate | up pair): [num_tokens, gated_half]."""
        if self.gated_half is None:
            raise ValueError(f"forward_gated needs a gate | up pair of equal parts, not {self.part_sizes}")
        return self.linear_method.apply_gated(self, x, self.bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            raise ValueError("a fused tensor where one part was expected")
        size = self.part_sizes[shard_id]
        param.data.narrow(0, self.part_offsets[shard_id], size).copy_(
            loaded.narrow(0, self.part_starts[shard_id], size))


def partition_heads(num_heads: int, num_kv_heads: int, state: ParallelState) -> tuple[int, int, int, int]:
    """This rank's (first query head, query heads, first KV head, KV heads).

    Query heads stay with their KV head (a GQA group never straddles ranks). With at least as many
    KV heads as ranks, whole groups are dealt out as evenly as possible (e.g. 3 groups on 2 ranks:
    1 + 2, so SmolLM2's 9 query heads split 3 + 6); with fewer, each KV head is replicated on
    ``tp / num_kv_heads`` ranks and the query heads split evenly.
    """
    tp, rank = state.tp_size, state.tp_rank
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads.")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        kv_start = rank * num_kv_heads // tp
        kv_end = (rank + 1) * num_kv_heads // tp
        return kv_start * group, (kv_end - kv_start) * group, kv_start, kv_end - kv_start
    if tp % num_kv_heads or num_heads % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of the {num_kv_heads} KV "
                         f"heads and divide the {num_heads} attention heads.")
    q_heads = num_heads // tp
    return rank * q_heads, q_heads, rank // (tp // num_kv_heads), 1


class QKVParallelLinear(LinearBase):
    shard_ids = (0, 1, 2)

    """q | k | v projections fused, split over the ranks by ``partition_heads``.

    Local layout: [q heads of this rank | its k heads | its v heads], each head ``head_dim`` rows.
    Shards 0/1/2 are q/k/v; ``shard_id=None`` is a checkpoint that stores them fused (GPT-2).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, linear_method: Optional[LinearMethod] = None) -> None:
        state = get_parallel_state()
        q_start, self.num_heads, kv_start, self.num_kv_heads = partition_heads(num_heads, num_kv_heads, state)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim  # local
        self.kv_size = self.num_kv_heads * head_dim  # local
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.part_starts = [q_start * head_dim, kv_start * head_dim, kv_start * head_dim]
        self.part_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.part_offsets = [0, self.q_size, self.q_size + self.kv_size]
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, linear_method)

    @property
    def q_shard(self) -> tuple[int, int]:
        """(start, length) of this rank's query features: the input shard of the output projection."""
        return self.part_starts[0], self.q_size

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:  # fused q | k | v in the checkpoint
            for i, part in enumerate(loaded.split(self.full_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        size = self.part_sizes[shard_id]
        param.data.narrow(0, self.part_offsets[shard_id], size).copy_(
            loaded.narrow(0, self.part_starts[shard_id], size))


class RowParallelLinear(LinearBase):
    """Input features split over the ranks (evenly, or as ``input_shard`` = (start, length) says,
    e.g. a QKV layer's ``q_shard``); partial outputs are summed by an all-reduce, then the bias
    (kept whole on every rank) is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 input_shard: Optional[tuple[int, int]] = None,
                 linear_method: Optional[LinearMethod] = None) -> None:
        state = get_parallel_state()
        self.in_start, local = input_shard or even_shard(input_size, state, "input size")
        super().__init__(local, output_size, bias, linear_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self.linear_method.apply(self, x, self.bias)
        out = tp_all_reduce(self.linear_method.apply(self, x, None), self.parallel)
        return out if self.bias is None else out.add_(self.bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param is self.bias:
            default_weight_loader(param, loaded)
        else:
            default_weight_loader(param, loaded.narrow(1, self.in_start, param.shape[1]))
