"""Attention launch grids fixed by Python ints, work found on the device (tandem_kernels.attention).

- Split-KV under CUDA-graph semantics: a decode launch recorded at capture (max_seq_len =
  max_model_len 131072, padded seq_len 1) and replayed as recorded, without re-running Python,
  after seq_lens are refilled, gives the reference's output and runs as many working
  (request, KV head, split) programs as an eager step at the real context.
- Prefill: programs cover the real query tiles, not requests x the longest query's tiles.

Without CUDA these run under TRITON_INTERPRET=1 (conftest.py) on CPU tensors.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernel_cases import make_paged_batch
from tandem_kernels import launch_config as L
from tandem_kernels import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H100_SMS = 132
# Llama-3.2-1B's attention: 32 query heads over 8 KV heads of 64 dims; 16-token blocks.
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16
MAX_MODEL_LEN = 131072


@pytest.fixture(scope="module")
def attention():
    from tandem_kernels import attention

    return attention


class LaunchRecorder:
    """Stands in for a @triton.jit kernel: records each launch (grid, arguments) and runs it."""

    def __init__(self, kernel, sink: list) -> None:
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.kernel, grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def nan_workspace(attention, sink: list):
    """_split_workspace whose buffers start as NaN: a working split overwrites its entries."""
    real = attention._split_workspace

    def workspace(*args):
        buffers = tuple(t.fill_(float("nan")) for t in real(*args))
        sink.append(buffers)
        return buffers
    return workspace


def working_programs(split_max: torch.Tensor) -> int:
    """(token, KV head, split) programs that wrote their row max (NaN-filled before the launch)."""
    group = HEADS // KV_HEADS
    return int((~split_max[:, ::group, :].isnan()).sum())


def graph_plan(b, seq_len: int) -> R.VarlenPlan:
    """The decode plan as backend/worker/cuda_graphs.py builds it: max_seq_len = max_model_len,
    block tables max_model_len wide (padding points at a real block)."""
    tables = b.block_tables.to(torch.int32)
    width = MAX_MODEL_LEN // BLOCK
    padded = torch.cat([tables, tables[:, :1].expand(-1, width - tables.shape[1])], dim=1).contiguous()
    return R.VarlenPlan(padded, torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
                        torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                        max_query_len=1, max_seq_len=MAX_MODEL_LEN)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("context", [1023, 300, 6000])
def test_captured_decode_replays_with_eager_occupancy(attention, monkeypatch, context):
    """Batch 1, 1k (and 300, 6k) tokens on a 131k-max_model_len graph: the replayed launch is
    right and runs the eager step's working programs (the layout that followed max_model_len
    ran 8 of 272 programs at 1k context where eager runs 32)."""
    seq_len = context + 1
    b = make_paged_batch([(context, 1)], HEADS, KV_HEADS, HEAD_DIM, BLOCK, torch.float32, DEVICE)
    scale = HEAD_DIM ** -0.5
    b_cpu = make_paged_batch([(context, 1)], HEADS, KV_HEADS, HEAD_DIM, BLOCK, torch.float32, "cpu")
    want = R.paged_attention(b_cpu.query, b_cpu.key, b_cpu.value, b_cpu.k_cache, b_cpu.v_cache,
                             b_cpu.plan(), scale)
    workspaces, launches = [], []
    monkeypatch.setattr(attention, "_split_workspace", nan_workspace(attention, workspaces))

    with attention.assume_sm_count(H100_SMS):
        eager = attention.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache,
                                          b.varlen_plan(), scale)
        eager_working = working_programs(workspaces[-1][1])

        # Capture: a padded row (seq_len 1), launches recorded.
        plan = graph_plan(b, seq_len=1)
        for name in ("_attention_kernel", "_merge_splits_kernel"):
            monkeypatch.setattr(attention, name, LaunchRecorder(getattr(attention, name), launches))
        attention.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache, plan, scale)
    assert [launch[0] for launch in launches] == [attention._attention_kernel.kernel,
                                                  attention._merge_splits_kernel.kernel]

    # Replay: the real seq_len refilled in place, the recorded launches rerun as they are.
    plan.seq_lens.fill_(seq_len)
    split_acc, split_max, split_sum = workspaces[-1]
    for buffer in (split_acc, split_max, split_sum):
        buffer.fill_(float("nan"))
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    replayed = launches[0][2][0]  # the launch's output tensor
    graph_working = working_programs(split_max)

    torch.testing.assert_close(replayed.cpu(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(eager.cpu(), want, atol=2e-5, rtol=2e-5)
    grid_splits = launches[0][1][2]
    splits, _ = L.request_partition(seq_len, grid_splits, L.MIN_PARTITION)
    assert graph_working == eager_working == KV_HEADS * splits
    if context == 1023:
        assert graph_working == 32  # 4 splits of 256 tokens x 8 KV heads
    if context == 6000:
        assert graph_working == 8 * 24  # 24 splits of 256 tokens (the grid holds 33)


def test_split_layout_does_not_depend_on_max_model_len():
    """The working programs of a batch-1 decode are the same for every max_seq_len bound."""
    for seq_len in (1, 64, 257, 1024, 5000, 131072):
        counts = set()
        for bound in (seq_len, 2 * seq_len, MAX_MODEL_LEN):
            grid, min_partition = L.kv_splits(1, KV_HEADS, 1, max(bound, seq_len), H100_SMS)
            counts.add(L.request_partition(seq_len, grid, min_partition)[0])
        assert len(counts) == 1, (seq_len, counts)
    with pytest.raises(ValueError, match="num_splits"):
        L.kv_splits(1, KV_HEADS, 1, 1024, H100_SMS, num_splits=L.MAX_SPLITS + 1)


def test_query_tile_grid_covers_every_tile_once():
    """Request r's tiles start at (start_r + r * (B - 1)) // B: steps hold its tiles, the grid
    holds them all, and at most one program per request is idle."""
    rng = random.Random(0)
    for _ in range(200):
        block_q = rng.choice([1, 2, 4, 16, 64])
        lens = [rng.choice([0, 1, 1, 1, rng.randint(1, 300)]) for _ in range(rng.randint(1, 40))]
        if max(lens) <= 1:
            lens[0] = 2
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        programs, steps = L.query_tile_grid(starts[-1], len(lens), max(lens), block_q)
        first = [(starts[r] + r * (block_q - 1)) // block_q for r in range(len(lens) + 1)]
        assert first[-1] == programs and (1 << steps) > len(lens) - 1
        real = 0
        for r, n in enumerate(lens):
            tiles = -(-n // block_q)
            assert first[r + 1] - first[r] in (tiles, tiles + 1)
            real += tiles
        assert real <= programs <= real + len(lens)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 16), (8, 1, 24)])
def test_prefill_grid_over_real_tiles(attention, monkeypatch, dtype, tol, heads, kv_heads, head_dim):
    """One long prefill among many decodes (and a chunk after a prefix): the reference's output
    from a grid of the real query tiles, far fewer programs than requests x the longest tiles."""
    rng = random.Random(1)
    shapes = [(0, 150)] + [(rng.randint(0, 90), 1) for _ in range(30)] + [(37, 20)]
    b = make_paged_batch(shapes, heads, kv_heads, head_dim, 8, dtype, DEVICE)
    launches = []
    monkeypatch.setattr(attention, "_attention_kernel", LaunchRecorder(attention._attention_kernel, launches))
    scale = head_dim ** -0.5
    got = attention.paged_attention(b.query, b.key, b.value, b.k_cache, b.v_cache, b.varlen_plan(), scale)
    b_cpu = make_paged_batch(shapes, heads, kv_heads, head_dim, 8, dtype, "cpu")
    want = R.paged_attention(b_cpu.query, b_cpu.key, b_cpu.value, b_cpu.k_cache, b_cpu.v_cache,
                             b_cpu.plan(), scale)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)

    block_q = L.attention_config(head_dim, heads // kv_heads, 150, b.query.element_size()).block_q
    real_tiles = sum(-(-n // block_q) for _, n in shapes)
    programs = launches[0][1][0]
    assert real_tiles <= programs <= real_tiles + len(shapes)
    assert programs < len(shapes) * -(-150 // block_q) // 3  # the old grid: requests x longest tiles
