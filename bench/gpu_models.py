"""The models and engine helpers of the GPU checks (bench/gpu_check.py, bench/step_profile.py).

Models are built from the config files in bench/configs/ with random weights from a seed; the
``Plan`` holds the sizes of a run: the real check on CUDA, or its ``--tiny`` CPU rehearsal.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"smollm2-135m": "smollm2-135m.json", "llama-3.2-1b": "llama-3.2-1b.json",
           "qwen2.5-0.5b": "qwen2.5-0.5b.json"}
# --tiny: every config shrunk to this (same architecture, same code paths).
TINY_OVERRIDES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512, bos_token_id=1, eos_token_id=2)


class Plan:
    """The sizes of one run: the real check or its --tiny CPU rehearsal."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.device = torch.device("cpu" if tiny else "cuda")
        # The serving dtype; fp32 on the CPU, whose bf16 matmuls are emulated (slow).
        self.dtype = torch.float32 if tiny else torch.bfloat16
        self.copy_bytes = 8 << 20 if tiny else 2 << 30
        self.matmul_n = 256 if tiny else 8192
        self.logit_prompts = [5, 9, 17] if tiny else [17, 64, 200]
        self.greedy_tokens = 4 if tiny else 16
        self.b1_prompt, self.b1_steps = (8, 6) if tiny else (128, 64)
        self.sweep = [1, 2, 4] if tiny else [1, 2, 4, 8, 16, 32, 64, 128, 256]
        self.sweep_prompt, self.sweep_steps = (48, 3) if tiny else (1008, 16)
        # prefill: (batch, prompt length) rows after a 1 x prefill_len one
        self.prefill_len = 40 if tiny else 1024
        self.prefill_shapes = [(1, 300), (3, 40)] if tiny else [(1, 8192), (8, 1024)]  # past max_model_len
        self.nano = dict(num_seqs=8, low=10, high=40) if tiny else dict(num_seqs=256, low=100, high=1024)
        self.max_model_len = 256 if tiny else 2304
        self.block_size = 16
        self.max_num_seqs = 8 if tiny else 256
        self.max_num_batched_tokens = 128 if tiny else 8192
        # long_context: the long engine's max_model_len and the (short, long) decode contexts.
        self.long_max_model_len = 4096 if tiny else 131072
        self.long_contexts = (40, 1000) if tiny else (1008, 32752)
        self.long_steps = 3 if tiny else 32



def build_checkpoint(name: str, out_dir: Path, dtype: torch.dtype, plan: Plan, seed: int = 0):
    """(directory, HF model on the device): config from bench/configs, weights random from seed."""
    import transformers as T
    from tokenizers import Tokenizer, models

    fields = json.loads((REPO / "bench" / "configs" / CONFIGS[name]).read_text())
    if plan.tiny:
        fields.update(TINY_OVERRIDES)
    config = T.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    with torch.device(plan.device):
        hf = T.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    hf.save_pretrained(str(out_dir))
    # The engine wants a tokenizer beside the weights; token IDs are all this check sends.
    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(out_dir / "tokenizer.json"))
    return out_dir, hf


def make_engine(model_dir: Path, plan: Plan, **kwargs):
    from backend.engine.llm_engine import LLMEngine
    from backend.types.config import EngineConfig

    kwargs.setdefault("dtype", str(plan.dtype).removeprefix("torch."))
    kwargs.setdefault("max_model_len", plan.max_model_len)
    kwargs.setdefault("max_num_seqs", plan.max_num_seqs)
    kwargs.setdefault("max_num_batched_tokens", plan.max_num_batched_tokens)
    kwargs.setdefault("enable_prefix_caching", False)
    if plan.tiny:
        kwargs.setdefault("num_kv_blocks", 1024)
        kwargs.setdefault("async_scheduling", True)  # as on CUDA, where it is the default
    engine = LLMEngine(EngineConfig(model=str(model_dir), device=plan.device.type, **kwargs))
    if plan.tiny and engine.async_scheduling:  # greedy decode steps left pending, as on CUDA
        engine.executor.defer_steps = True
    return engine


def release(*objects) -> None:
    for obj in objects:
        if hasattr(obj, "shutdown"):
            obj.shutdown()
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def runner_of(engine):
    return engine.executor.worker.runner


def weight_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in runner_of(engine).model.parameters())


def kv_bytes_per_token(engine) -> float:
    runner = runner_of(engine)
    return runner.kv_bytes_per_block() / runner.block_size


def random_prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def decode_steps(engine, prompts, num_steps: int):
    """Prefill prompts (untimed), then time num_steps steps in which all of them decode.
    Returns (median step seconds, mean context over the timed steps, each request's tokens)."""
    from backend.types.sampling_params import SamplingParams

    # Enough tokens that no request ends while others still prefill; aborted afterwards.
    params = SamplingParams(temperature=0.0, max_tokens=engine.config.max_model_len - max(map(len, prompts)),
                            ignore_eos=True)
    ids = [str(i) for i in range(len(prompts))]
    tokens = {i: [] for i in ids}
    for i, p in zip(ids, prompts):
        engine.add_request(i, p, params)

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids

    while any(not t for t in tokens.values()):  # until every prompt is in and sampled once
        step()
    context = statistics.mean(len(p) + len(tokens[i]) for i, p in zip(ids, prompts)) + num_steps / 2
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    engine.abort_request(ids)
    for _ in range(4):  # with async scheduling a launched step is still in flight: process it
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests() and num_steps < params.max_tokens
    return statistics.median(times), context, [tokens[i] for i in ids]
