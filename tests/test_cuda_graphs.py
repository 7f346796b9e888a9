"""The CUDA runner's logic on the CPU: decode graphs with FakeGraph (sizes, padding, buffer
reuse; an engine whose decode steps replay captured graphs still matches HF greedy) and
the profiling step that sizes the KV cache on a GPU.

GPU twin: tests/test_gpu.py (real CUDA graphs, eager and graphs against HF on CUDA).
"""

from __future__ import annotations

import pytest
import torch
from test_correctness import GREEDY, hf_greedy, make_engine, random_prompts, run_engine

from backend.models.attention import AttentionMetadata
from backend.models.resolve import resolve_config
from backend.worker import cuda_graphs
from backend.worker.cuda_graphs import DecodeGraphs, FakeGraph, capture_sizes, padded_size

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(256, CUDA) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(100, CUDA)[-3:] == [88, 96, 100]
    assert capture_sizes(3, CUDA) == [1, 2, 3] and capture_sizes(1, CUDA) == [1]
    assert capture_sizes(4096, CUDA)[-1] == cuda_graphs.MAX_CAPTURE_SIZE
    sizes = capture_sizes(100, CUDA)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 97, 100)] == [1, 4, 8, 8, 16, 100, 100]
    assert padded_size(101, sizes) is None


def test_cpu_captures_exact_small_sizes_only():
    """A CPU computes padding rows for real: each size up to CPU_MAX_CAPTURE_SIZE, no padding."""
    top = cuda_graphs.CPU_MAX_CAPTURE_SIZE
    assert capture_sizes(256, CPU) == list(range(1, top + 1))
    assert capture_sizes(3, CPU) == [1, 2, 3]
    sizes = capture_sizes(256, CPU)
    assert [padded_size(n, sizes) for n in range(1, top + 1)] == list(range(1, top + 1))
    assert padded_size(top + 1, sizes) is None


class RecordingModel(torch.nn.Module):
    """Stands in for a model: records what each call saw; hidden row = (token id, seq_len)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, input_ids, positions, meta):
        self.calls.append(dict(ptr=input_ids.data_ptr(), ids=input_ids.tolist(), slots=meta.slot_mapping.tolist(),
                               tables=meta.block_tables[:, 0].tolist(), seq_lens=meta.seq_lens.tolist(),
                               plan_ptr=meta.plan.seq_lens.data_ptr()))
        return torch.stack([input_ids.float(), meta.seq_lens.float()], dim=1)


def decode_meta(slots, tables, seq_lens):
    n = len(slots)
    return AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                             max_query_len=1, max_seq_len=max(seq_lens))


def test_replays_reuse_the_buffers_and_reset_padding_rows():
    model = RecordingModel()
    graphs = DecodeGraphs(model, [1, 2, 4, 8], max_blocks_per_seq=4, max_model_len=64, pad_block=9,
                          block_size=4, device=torch.device("cpu"), graph_cls=FakeGraph)
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    captured = {len(c["ids"]): c for c in model.calls}
    model.calls.clear()

    # 7 requests -> the size-8 graph; then 5 -> also 8, and row 5..7 must be padding again.
    seven = graphs.run(torch.arange(10, 17), torch.arange(7), decode_meta(
        list(range(7)), [[b, b + 1] for b in range(7)], [3] * 7))
    assert seven.tolist() == [[float(t), 3.0] for t in range(10, 17)]
    five = graphs.run(torch.arange(20, 25), torch.arange(5), decode_meta(
        [40, 41, 42, 43, 44], [[b] for b in range(5)], [2] * 5))
    assert five.shape == (5, 2) and five.tolist() == [[float(t), 2.0] for t in range(20, 25)]
    last = model.calls[-1]
    assert last["ids"] == [20, 21, 22, 23, 24, 0, 0, 0]
    assert last["slots"] == [40, 41, 42, 43, 44, 36, 36, 36]  # pad slot = pad block 9 * block size 4
    assert last["tables"] == [0, 1, 2, 3, 4, 9, 9, 9]
    assert last["seq_lens"] == [2] * 5 + [1] * 3
    # Every replay of a size reads the very tensors it was captured with.
    assert all(c["ptr"] == captured[8]["ptr"] and c["plan_ptr"] == captured[8]["plan_ptr"]
               for c in model.calls)
    assert graphs.graphs[8].num_replays == 2 and graphs.graphs[1].num_replays == 0

    one = graphs.run(torch.tensor([5]), torch.tensor([0]), decode_meta([1], [[0]], [1]))
    assert one.tolist() == [[5.0, 1.0]] and graphs.graphs[1].num_replays == 1


def test_fits_only_decode_batches_within_the_captured_shapes():
    graphs = DecodeGraphs(RecordingModel(), [1, 2], max_blocks_per_seq=4, max_model_len=16, pad_block=0,
                          block_size=4, device=torch.device("cpu"), graph_cls=FakeGraph)
    assert graphs.fits(decode_meta([0, 1], [[0], [1]], [1, 1]))
    assert not graphs.fits(decode_meta([0, 1, 2], [[0], [1], [2]], [1, 1, 1]))  # larger than any size
    prefill = decode_meta([0, 1], [[0], [1]], [2, 2])
    prefill.max_query_len = 2
    assert not graphs.fits(prefill)


@pytest.fixture
def fake_graphs(monkeypatch):
    """The CUDA runner's graph logic on the CPU: FakeGraph replays at CUDA's (padded) sizes."""
    cuda_sizes = cuda_graphs.capture_sizes
    monkeypatch.setattr(cuda_graphs, "graph_class", lambda device: FakeGraph)
    monkeypatch.setattr(cuda_graphs, "capture_sizes", lambda max_num_seqs, device: cuda_sizes(max_num_seqs, CUDA))


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_engine_with_graph_replays_matches_hf_greedy(tiny_checkpoint, fake_graphs, arch):
    model_dir = tiny_checkpoint(arch)
    prompts = random_prompts([1, 5, 9, 17, 3], 384)
    expected = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    engine = make_engine(model_dir, max_num_seqs=8, max_num_batched_tokens=32)
    runner = engine.executor.worker.runner
    assert runner.graphs.sizes == [1, 2, 4, 8]
    # The scratch block for padding rows lies past the scheduler's blocks.
    assert runner.kv_caches[0][0].shape[0] == engine.block_manager.num_blocks + 1
    assert run_engine(engine, prompts, GREEDY) == expected  # 5 running -> padded to 8
    assert run_engine(engine, prompts[:3], GREEDY) == expected[:3]  # 3 -> 4: rows 3 pad again
    replays = {size: g.num_replays for size, g in runner.graphs.graphs.items()}
    assert replays[8] > 0 and replays[4] > 0


def test_enforce_eager_captures_nothing(tiny_checkpoint, fake_graphs):
    engine = make_engine(tiny_checkpoint("llama"), enforce_eager=True)
    runner = engine.executor.worker.runner
    assert runner.graphs is None
    assert runner.kv_caches[0][0].shape[0] == engine.block_manager.num_blocks


def test_profile_step_runs_the_largest_step_and_unbinds_its_cache(tiny_checkpoint):
    """The step the CUDA runner measures before sizing the KV cache (here on the CPU)."""
    from backend.types.config import EngineConfig
    from backend.worker.worker import Worker

    config = resolve_config(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4,
                          max_num_seqs=5, max_num_batched_tokens=47, max_model_len=64))
    worker = Worker(config)
    worker.load_model()
    runner = worker.runner
    kv_bytes = runner.profile_step()
    # 47 tokens over 5 requests: 10, 10, 9, 9, 9 tokens = 3 + 3 + 3 + 3 + 3 blocks of 4
    per_block = runner.kv_bytes_per_block()
    assert kv_bytes == 15 * per_block
    assert runner.kv_caches == [] and all(layer.kv_cache is None for layer in runner.attn_layers)
