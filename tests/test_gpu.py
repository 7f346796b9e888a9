"""The engine on a CUDA device (skipped without one). CPU twin: tests/test_correctness.py."""

from __future__ import annotations

import pytest

from test_correctness import GREEDY, PROMPT_LENGTHS, hf_greedy, make_engine, random_prompts, run_engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_cuda_greedy_matches_hf(tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch)
    prompts = random_prompts(PROMPT_LENGTHS, 384)
    expected = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    engine = make_engine(model_dir, device="cuda", max_num_batched_tokens=32)
    assert run_engine(engine, prompts, GREEDY) == expected
