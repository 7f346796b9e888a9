"""Shared fixtures: tiny random-weight checkpoints (with a tokenizer) and the default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TINY_VOCAB = 384
CORPUS = [
    "The capital of France is Paris. The largest ocean is the Pacific Ocean.",
    "Tandem serves language models with a paged KV cache and continuous batching.",
    "请介绍一下你自己。 你好，世界！ Emoji: 😀🚀",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time, a small model generated tokens one by one.",
]


def build_tokenizer(out_dir: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A byte-level BPE with chat special tokens and a ChatML template, saved to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(str(out_dir))


def tiny_config(arch: str):
    """A small transformers config of the given family; no EOS so greedy runs are full length."""
    import transformers as T

    common = dict(vocab_size=TINY_VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch in ("llama", "qwen2", "mistral"):
        cls = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "mistral": T.MistralConfig}[arch]
        return cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=arch == "qwen2",
                   **common)
    if arch == "opt":
        return T.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=512, word_embed_proj_dim=64, **common)
    if arch == "gpt2":
        return T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
    raise ValueError(arch)


def make_tiny_checkpoint(out_dir: Path, arch: str, seed: int = 0) -> Path:
    import torch
    import transformers as T

    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(tiny_config(arch))
    model.save_pretrained(str(out_dir))
    build_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch) -> a saved random-weight HF directory (cached per session)."""
    made: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in made:
            made[arch] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return made[arch]

    return get


@pytest.fixture(scope="module")
def tiny_llama_engine(tiny_checkpoint):
    """An LLMEngine on the tiny random Llama (fp32, 256 blocks of 4 tokens, 256-token context), per module."""
    from backend.engine.llm_engine import LLMEngine
    from backend.types.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", block_size=4,
                                    num_kv_blocks=256, max_model_len=256))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct, fetched and converted once into $TANDEM_CACHE."""
    from backend.models.loader import resolve_model
    from backend.types.config import EngineConfig

    return resolve_model(None, cache_dir=EngineConfig().cache_dir)


def pytest_configure(config):
    import torch

    # Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors. Triton
    # reads this when a kernel module is imported, so it is set before any test module loads.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (a CPU twin covers this)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
