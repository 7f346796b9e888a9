"""Decode graphs: the decode step captured once per batch size, replayed with refilled buffers.

On CUDA a graph is a ``torch.cuda.CUDAGraph`` (no launch overhead); on the CPU it is a
``TracedGraph`` (traced_graph.py: the step's ops recorded once and replayed without the model's
Python), at the exact sizes 1..``CPU_MAX_CAPTURE_SIZE``: a CPU computes padded rows for real, so
it pads nothing, and above a few rows the Python a graph saves is a small part of the step.

A decode-only step (one query token per request) of n requests replays the graph
captured for the smallest size B >= n. The graph's kernels read persistent input
buffers (token IDs, positions, slots, block tables, sequence lengths) and write a
persistent hidden-state buffer; a step copies its inputs into rows [0, n) and
points rows [n, B) at a scratch KV block that no request owns::

    row        0 .. n-1                  n .. B-1 (padding)
    input_ids  the step's tokens         0
    positions  the step's positions      0
    slot       the step's slots          pad_block * block_size   (scratch; never read back)
    block row  the request's table       [pad_block, ...]
    seq_len    the request's length      1

so padded rows compute finite garbage that nobody reads and touch no request's
blocks. Logits and sampling run after the replay, on rows [0, n).

When: CUDA graphs are all captured before serving (capturing one while other work runs on the
device conflicts with torch's global capture mode, and none can be kept across processes). A
CPU's traced graph is recorded the first time its batch size runs (``captured_on_first_use``):
that step runs with the recording on (the warm-up and the traced run both compute it for real),
so a start captures nothing and the server answers as soon as the model is loaded; capturing all
32 sizes up front took 11-57 s of a 2-core machine's start.

The graph object is a seam: on CUDA it is a ``torch.cuda.CUDAGraph``; CPU tests
(and ``bench/gpu_check.py --tiny``) use ``FakeGraph``, which replays by calling
the captured function again on the same buffers, so the size list, the padding
and the buffer reuse are exercised without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable, Optional

import torch

from tandem_kernels import ops as kernels
from backend.models.attention import AttentionMetadata
from backend.types.startup_log import log_phase
from backend.worker.traced_graph import TracedGraph

# Named for what it logs, CUDA or CPU graphs alike (this module's name predates the CPU's).
logger = logging.getLogger("backend.worker.decode_graphs")

MAX_CAPTURE_SIZE = 512  # larger decode batches run eagerly (their launch overhead is amortized)
CPU_MAX_CAPTURE_SIZE = 32  # CPU: ~1.5-3 ms of Python saved per step: 14 % of batch 1, ~5 % of batch 32 (median)


def capture_sizes(max_num_seqs: int, device: torch.device) -> list[int]:
    """The decode batch sizes to capture. CUDA: 1, 2, 4, then every multiple of 8, up to
    max_num_seqs (itself included, so every batch the scheduler forms fits one). CPU: every
    size from 1 to min(max_num_seqs, CPU_MAX_CAPTURE_SIZE), so no batch is padded."""
    if device.type == "cpu":
        return list(range(1, min(max_num_seqs, CPU_MAX_CAPTURE_SIZE) + 1))
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return sizes + [top]


def padded_size(n: int, sizes: list[int]) -> Optional[int]:
    """The smallest captured size >= n, or None when n exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the two calls DecodeGraphs makes; all share one pool."""

    kind = "CUDA graphs"
    captured_on_first_use = False

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], None]) -> None:
        with torch.cuda.graph(self.graph, pool=self.pool):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class FakeGraph:
    """Replays by calling the captured function again (CPU tests of the capture logic, which
    capture up front as CUDA does)."""

    kind = "stand-in graphs (FakeGraph)"
    captured_on_first_use = False

    def __init__(self, pool=None) -> None:
        self.fn: Optional[Callable[[], None]] = None
        self.num_replays = 0

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        fn()

    def replay(self) -> None:
        self.num_replays += 1
        self.fn()


def graph_class(device: torch.device) -> Optional[type]:
    """The graph implementation for a device: CUDA graphs on CUDA; on the CPU traced graphs when
    the fused kernels run (their decode step reads only tensors: ``kernels.VarlenPlan``; the
    reference path plans on the host); none (eager) elsewhere. Tests replace this to run
    FakeGraph on the CPU."""
    if device.type == "cuda":
        return CudaGraph
    if device.type == "cpu" and kernels.cpu.available():
        return TracedGraph
    return None


class DecodeGraphs:
    """One captured decode step per size in ``sizes``, sharing persistent buffers.

    model(input_ids, positions, meta) -> [num_tokens, hidden] must only launch
    device work (no host syncs) for decode batches; kernels read the metadata
    through ``kernels.VarlenPlan``, whose tensors are views of these buffers.
    """

    def __init__(self, model: torch.nn.Module, sizes: list[int], max_blocks_per_seq: int,
                 max_model_len: int, pad_block: int, block_size: int, device: torch.device,
                 graph_cls: type) -> None:
        self.model = model
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.pad_slot = pad_block * block_size
        self.pad_block = pad_block
        self.graph_cls = graph_cls
        self.device = device
        n = self.sizes[-1]
        with torch.inference_mode():
            self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
            self.positions = torch.zeros(n, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((n,), self.pad_slot, dtype=torch.int64, device=device)
            self.block_tables = torch.full((n, max_blocks_per_seq), pad_block, dtype=torch.int32, device=device)
            self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token per row
        self.hidden: Optional[torch.Tensor] = None  # [max_size, hidden], made by the first warm-up
        self.graphs: dict[int, object] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, size: int) -> AttentionMetadata:
        block_tables = self.block_tables[:size]
        seq_lens = self.seq_lens[:size]
        query_start_loc = self.query_start_loc[:size + 1]
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], block_tables=block_tables,
                                 seq_lens=seq_lens, query_start_loc=query_start_loc,
                                 max_query_len=1, max_seq_len=self.max_model_len)
        meta.plan = kernels.VarlenPlan(block_tables, seq_lens, query_start_loc, max_query_len=1,
                                       max_seq_len=self.max_model_len)
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (smaller graphs reuse its pool memory); for a graph
        class ``captured_on_first_use``, none now: ``run`` captures each size when it first runs."""
        start = time.perf_counter()
        kind = self.graph_cls.kind
        if self.graph_cls.captured_on_first_use:
            self.capture_seconds, self.capture_mib = 0.0, 0.0
            log_phase(logger, "decode graphs", f"{len(self.sizes)} {kind} (batch sizes {self.sizes[0]}.."
                      f"{self.sizes[-1]}), each captured when its batch size first runs", 0.0)
            return
        cuda = self.device.type == "cuda"
        before = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        pool = torch.cuda.graph_pool_handle() if cuda else None
        for size in reversed(self.sizes):
            self._capture(size, pool)
        if cuda:
            torch.cuda.synchronize(self.device)
        used = (before - torch.cuda.mem_get_info(self.device)[0]) / 2 ** 20 if cuda else 0.0
        self.capture_seconds = time.perf_counter() - start
        self.capture_mib = used
        log_phase(logger, "decode graphs", f"captured {len(self.sizes)} {kind} (batch sizes {self.sizes[0]}.."
                  f"{self.sizes[-1]}), using {used:.0f} MiB", self.capture_seconds)

    def _capture(self, size: int, pool) -> None:
        """Capture the graph of ``size`` rows from the buffers as they are (running the step)."""
        meta = self._metadata(size)

        def step() -> None:
            self.hidden[:size].copy_(self.model(self.input_ids[:size], self.positions[:size], meta))

        if self.hidden is None:  # [max_size, hidden]: shaped by this size's output
            out = self.model(self.input_ids[:size], self.positions[:size], meta)
            self.hidden = out.new_zeros((self.max_size, *out.shape[1:]))
        step()  # warm-up outside the graph: compiles kernels, sizes workspaces
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        graph = self.graph_cls(pool)
        graph.capture(step)
        self.graphs[size] = graph

    def fits(self, meta: AttentionMetadata) -> bool:
        """A decode-only step that a captured graph can run."""
        return (meta.max_query_len == 1 and meta.seq_lens.shape[0] <= self.max_size
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for this step's batch; returns hidden states [num_reqs, hidden]
        (a view of the persistent buffer: valid until the next replay)."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        if n < size:  # rows a larger batch filled before: back to the scratch block
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.pad_slot)
            self.block_tables[n:size, 0].fill_(self.pad_block)
            self.seq_lens[n:size].fill_(1)
        if size in self.graphs:
            self.graphs[size].replay()
        else:  # captured on first use: recording the step runs it, on this step's inputs
            start = time.perf_counter()
            self._capture(size, None)
            logger.info("Captured the %s of batch size %d on its first use in %.2f s", self.graph_cls.kind,
                        size, time.perf_counter() - start)
        return self.hidden[:n]
