"""Greedy outputs equal Hugging Face transformers token for token.

Tiny random-weight Llama, Qwen2, Mistral, OPT and GPT-2 checkpoints, and the
real default model; alone, batched, with prefix caching on and off, and under
a KV cache small enough to force preemption. Everything in fp32 against HF fp32.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

from backend.engine.llm_engine import LLMEngine
from backend.types.config import EngineConfig
from backend.types.sampling_params import SamplingParams

PROMPT_LENGTHS = [1, 3, 7, 16, 17, 33, 50, 90]
MAX_TOKENS = 16


def random_prompts(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model_dir, prompts, max_tokens):
    hf = T.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            seq = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist()
            eos = hf.generation_config.eos_token_id
            eos = [eos] if isinstance(eos, int) else (eos or [])
            pad = hf.generation_config.pad_token_id
            while seq and seq[-1] == pad and pad not in eos:  # HF pads a batch-1 run? never, but be exact
                seq.pop()
            outs.append(seq)
    return outs


def run_engine(engine: LLMEngine, prompts, params: SamplingParams):
    """Token IDs per prompt, all requests in flight together."""
    results = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] += out.new_token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [results[str(i)] for i in range(len(prompts))]


def make_engine(model_dir, **kwargs) -> LLMEngine:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_kv_blocks", 512)
    return LLMEngine(EngineConfig(model=str(model_dir), **kwargs))


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "opt", "gpt2"])
def test_tiny_models_match_hf_greedy(tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch)
    prompts = random_prompts(PROMPT_LENGTHS, 384)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    # A small token budget makes the longer prompts arrive in chunks.
    got = run_engine(make_engine(model_dir, max_num_batched_tokens=32), prompts, GREEDY)
    assert got == expected


def test_same_tokens_alone_batched_cached_and_preempted(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    prompts = random_prompts(PROMPT_LENGTHS, 384)
    alone = [run_engine(make_engine(model_dir), [p], GREEDY)[0] for p in prompts[:3]]

    # Batched with 31 others (sharing prefixes with each other, so the cache gets hits).
    others = random_prompts([20 + i for i in range(24)], 384, seed=7)
    others += [prompts[5][:10] + o[:8] for o in others[:7]]
    batch = prompts[:3] + others[:29]
    assert len(batch) == 32
    for caching in (True, False):
        engine = make_engine(model_dir, enable_prefix_caching=caching)
        got = run_engine(engine, batch, GREEDY)
        assert got[:3] == alone
        # Re-running the same prompts on a warm cache changes nothing.
        assert run_engine(engine, batch, GREEDY) == got
        assert (engine.block_manager.num_prefix_hits > 0) == caching

    # So little KV cache that requests must be preempted and recomputed.
    engine = make_engine(model_dir, num_kv_blocks=40, max_model_len=128)
    got = run_engine(engine, batch, GREEDY)
    assert engine.scheduler.num_preemptions_total > 0
    assert got[:3] == alone
    full = run_engine(make_engine(model_dir), batch, GREEDY)
    assert got == full


def test_logprobs_match_hf_log_softmax(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    prompt = random_prompts([12], 384)[0]
    engine = make_engine(model_dir)
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=5,
                                                   prompt_logprobs=3))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    hf = T.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)  # [len, vocab]

    for step, out in enumerate(outs):
        (position,) = out.new_logprobs
        row = ref[len(prompt) - 1 + step]
        ids = list(position)
        assert ids[0] == out.new_token_ids[0]  # the chosen token first
        top5 = torch.topk(row, 5).indices.tolist()
        assert set(ids) == set(top5) | {ids[0]}
        for token_id, lp in position.items():
            assert abs(lp.logprob - row[token_id].item()) < 1e-3
            assert lp.rank == 1 + int((row > row[token_id]).sum())

    prompt_lps = outs[0].prompt_logprobs
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = prompt_lps[pos]
        assert next(iter(entry)) == prompt[pos]
        assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-3


@pytest.mark.slow
def test_default_model_matches_hf_greedy(default_model_dir):
    from frontend.tokenizer import load_tokenizer

    tok = load_tokenizer(str(default_model_dir))
    texts = ["The capital of France is", "Hi", "Write a haiku about the sea.",
             "1, 2, 3, 4,", "def fibonacci(n):", "请介绍一下你自己",
             "The quick brown fox jumps over the lazy dog. " * 3,
             "In a distant galaxy, long before the first stars had formed, there was a " * 4]
    prompts = [tok.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == len(prompts)
    expected = hf_greedy(default_model_dir, prompts, 24)
    engine = make_engine(default_model_dir, block_size=16, num_kv_blocks=256, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    assert run_engine(engine, prompts, params) == expected
    # Batched with 24 more prompts, on a warm prefix cache.
    more = [tok.encode(f"Story number {i}: once upon a time") for i in range(24)]
    assert run_engine(engine, prompts + more, params)[:len(prompts)] == expected
