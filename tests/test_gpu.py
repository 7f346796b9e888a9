"""The engine on a CUDA device (skipped without one), eager and with CUDA graphs.

CPU twins: tests/test_correctness.py (the same HF comparisons on the CPU) and
tests/test_cuda_graphs.py (the graph logic, with FakeGraph replays).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_correctness import (GREEDY, PROMPT_LENGTHS, hf_greedy, make_engine, random_prompts,
                              run_engine)

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt", "gpt2"])
def test_cuda_greedy_matches_hf(tiny_checkpoint, arch, enforce_eager):
    model_dir = tiny_checkpoint(arch)
    prompts = random_prompts(PROMPT_LENGTHS, 384)
    expected = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    engine = make_engine(model_dir, device="cuda", max_num_batched_tokens=32, max_num_seqs=16,
                         enforce_eager=enforce_eager)
    assert (engine.executor.worker.runner.graphs is None) == enforce_eager
    assert run_engine(engine, prompts, GREEDY) == expected


@pytest.fixture(scope="module")
def smollm2_shape(tmp_path_factory):
    """SmolLM2-135M's config (bench/configs) with random fp32 weights from seed 0."""
    import transformers as T

    from conftest import build_tokenizer

    fields = json.loads((REPO / "bench" / "configs" / "smollm2-135m.json").read_text())
    config = T.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("smollm2-shape")
    T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(out))
    build_tokenizer(out)
    return out


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_cuda_smollm2_greedy_matches_hf_on_cuda(smollm2_shape, enforce_eager):
    import transformers as T

    prompts = random_prompts([5, 40, 130, 17, 300, 64, 1, 90], 49152)
    hf = T.AutoModelForCausalLM.from_pretrained(str(smollm2_shape), dtype=torch.float32).cuda().eval()
    expected = []
    with torch.no_grad():
        for p in prompts:  # greedy without EOS, as the engine with ignore_eos
            ids = torch.tensor([p], device="cuda")
            for _ in range(GREEDY.max_tokens):
                ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
            expected.append(ids[0, len(p):].tolist())
    del hf
    engine = make_engine(smollm2_shape, device="cuda", block_size=16, max_model_len=1024,
                         max_num_batched_tokens=256, enforce_eager=enforce_eager)
    params = type(GREEDY)(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True)
    assert run_engine(engine, prompts, params) == expected


def test_cuda_kv_cache_sized_from_gpu_memory_utilization(smollm2_shape):
    """No num_kv_blocks: a profiling step, then the cache fills gpu_memory_utilization of the
    device less what is in use (weights and activations: well under 4 GiB here)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    in_use_before = total - free
    engine = make_engine(smollm2_shape, device="cuda", num_kv_blocks=None, gpu_memory_utilization=0.3,
                         block_size=16, max_num_seqs=1024, enforce_eager=True)
    runner = engine.executor.worker.runner
    kv_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_caches)
    budget = 0.3 * total - in_use_before
    assert budget - 4 * 2 ** 30 < kv_bytes <= budget
    assert engine.block_manager.num_blocks == runner.kv_caches[0][0].shape[0]
