"""A CPU engine's start-up memory: the KV cache, every layer's K and V zeroed by the kernel on first
touch (backend.models.huge_pages.zeroed_tensor), one mapping each, sized by the KV budget as before;
a cache larger than the host's available memory refused at start-up; and the embedding tables left
out of the huge-page collapse where no linear layer multiplies by them."""

from __future__ import annotations

import pytest
import torch
from test_correctness import make_engine, random_prompts, run_engine

import backend.worker.model_runner as model_runner
from backend.models.linear_methods import LinearMethod
from backend.types.sampling_params import SamplingParams
from backend.worker.host_memory import host_memory_available


def resident_bytes(address: int) -> int:
    """The resident bytes of the mapping that holds ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields[0].split("-")) == 2 and not fields[0].endswith(":"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                inside = lo <= address < hi
            elif inside and fields[0] == "Rss:":
                return int(fields[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_fresh_cpu_kv_cache_is_zeros_one_mapping_per_tensor_and_fills_the_budget(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    engine = make_engine(model_dir, num_kv_blocks=None, kv_cache_memory_gb=0.01)
    runner = engine.executor.worker.runner
    caches = [cache for kv in runner.kv_caches for cache in kv]
    assert len(caches) == 2 * len(runner.attn_layers)
    # Zeroed without being written: nothing of it resident yet (read before any value is).
    assert all(resident_bytes(cache.data_ptr()) < cache.nbytes // 4 for cache in caches)
    assert all(int(torch.count_nonzero(cache)) == 0 for cache in caches)
    # Each tensor its own memory: no two share a storage (a write to one is seen nowhere else).
    assert len({cache.untyped_storage().data_ptr() for cache in caches}) == len(caches)
    # The budget's accounting: the blocks that fit 0.01 GiB, and exactly their bytes allocated
    # (with the decode graphs' padding block).
    num_blocks = engine.block_manager.num_blocks
    assert num_blocks == int(0.01 * 2 ** 30 // runner.kv_bytes_per_block())
    allocated = num_blocks + (runner.graph_cls is not None)
    assert sum(cache.numel() * cache.element_size() for cache in caches) == allocated * runner.kv_bytes_per_block()


def test_an_engine_writes_and_reads_back_its_lazily_zeroed_cache(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    engine = make_engine(model_dir, num_kv_blocks=None, kv_cache_memory_gb=0.01)
    prompts = random_prompts([5, 23], 384)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    batched = run_engine(engine, prompts, greedy)
    runner = engine.executor.worker.runner
    assert any(int(torch.count_nonzero(k)) > 0 for k, _ in runner.kv_caches)  # writable, and written
    assert [run_engine(engine, [p], greedy)[0] for p in prompts] == batched


def test_a_tied_embedding_is_skipped_by_the_collapse_only_when_its_head_runs_a_form_of_its_own(
        tiny_checkpoint, monkeypatch):
    model_dir = tiny_checkpoint("qwen2")  # tied word embeddings
    runner = make_engine(model_dir).executor.worker.runner
    table = runner.model.model.embed_tokens.weight
    assert runner.model.lm_head.weight is table
    if torch.backends.mkldnn.is_available():  # the fp32 head runs oneDNN's reordered copy:
        assert runner._gathered_only_tables() == [(table.data_ptr(), table.nbytes)]  # the table is only gathered
    monkeypatch.setattr(model_runner, "linear_method_for", lambda *args: LinearMethod())  # multiplies by .weight
    runner = make_engine(model_dir).executor.worker.runner
    assert runner._gathered_only_tables() == []


def test_a_cpu_kv_cache_larger_than_the_available_host_memory_is_refused_at_start_up(tiny_checkpoint, monkeypatch):
    """The lazily zeroed cache would start and be killed under load: it is refused at start-up, the
    message naming the setting to lower; one that fits starts."""
    model_dir = tiny_checkpoint("llama")
    monkeypatch.setattr(model_runner, "host_memory_available", lambda: 4 << 20)
    with pytest.raises(RuntimeError, match="kv_cache_memory_gb"):
        make_engine(model_dir, num_kv_blocks=None, kv_cache_memory_gb=0.01)  # 10 MiB
    engine = make_engine(model_dir, num_kv_blocks=None, kv_cache_memory_gb=0.002)  # 2 MiB
    assert engine.block_manager.num_blocks > 0


def test_host_memory_available_is_the_smaller_of_meminfo_and_the_cgroups_room(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   1000 kB\n")
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text("3000000\n")
    usage.write_text("1000000\n")
    cgroup = ((str(limit), str(usage)),)
    assert host_memory_available(str(meminfo), cgroup) == 1000 * 1024  # meminfo the smaller
    meminfo.write_text("MemAvailable:   8000 kB\n")
    assert host_memory_available(str(meminfo), cgroup) == 2000000  # the cgroup's room the smaller
    limit.write_text("max\n")  # no limit
    assert host_memory_available(str(meminfo), cgroup) == 8000 * 1024
    assert host_memory_available(str(tmp_path / "absent"), ((str(tmp_path / "no"), str(usage)),)) is None
