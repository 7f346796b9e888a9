"""Converting a llama-architecture GGUF file into a Hugging Face directory in one pass.

``conversion.convert_gguf_with_transformers`` lets transformers load the whole model from the file
and saves its state dict: transformers parses the header three times with ``gguf.GGUFReader``
(~8 s each for a 49k-token vocabulary on 2 cores) and rebuilds its tensor-name table once per
module (~11 s), so SmolLM2-135M took ~50 s. Here the header is read once (``gguf_file.read_gguf``,
under a second), each tensor is dequantized once with gguf's own ``dequantize`` (the values
transformers loads), llama.cpp's rotary row order of q and k is undone as transformers undoes it,
and the state dict goes straight to model.safetensors; the config comes from the same metadata
renames transformers applies (``GGUF_CONFIG_MAPPING``) and the tokenizer from transformers' GGUF
tokenizer reader, which is already fast. The files written are byte for byte the ones the
transformers path writes (tests/test_gguf_llama_convert.py compares them).

``one_pass_plan`` says whether a file is covered: a llama GGUF (not one transformers treats as
mistral) whose every tensor has a llama name here, with transformers >= 5 (whose tokenizer class
for a llama GGUF is ``TokenizersBackend``) and no tokenizer_config.json beside the file (which
could name another class). Anything else returns None and takes the transformers path.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from backend.models.gguf_file import GgufFile, GgufFormatError, GgufTensor, read_gguf

ARCHITECTURE = "llama"
CONVERTED_WEIGHTS = "model.safetensors"  # conversion.CONVERTED_MARKER (not imported: no cycle)

# GGUF tensor name -> checkpoint name; {i} is the layer.
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.(?P<part>\w+)\.weight")


@dataclass
class OnePassPlan:
    """What ``convert_llama_gguf`` needs, decided before anything is written."""

    gguf: GgufFile
    names: dict[str, str]  # GGUF tensor name -> checkpoint name
    config_dict: dict  # what transformers' GGUF config reader would make of the metadata


def checkpoint_name(gguf_name: str) -> Optional[str]:
    """The checkpoint name of a llama GGUF tensor, or None for a name this converter does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match["part"] in _LAYER_NAMES:
        return f"model.layers.{match['layer']}.{_LAYER_NAMES[match['part']]}.weight"
    return None


def expected_names(num_layers: int, tied: bool) -> set[str]:
    """Every weight a LlamaForCausalLM of ``num_layers`` layers saves (``lm_head`` only when untied)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not tied else set())
    for i in range(num_layers):
        names |= {f"model.layers.{i}.{part}.weight" for part in _LAYER_NAMES.values()}
    return names


def config_dict_from_metadata(gguf: GgufFile) -> dict:
    """The config dict transformers' GGUF reader makes for a llama file: the metadata keys it renames
    (``GGUF_CONFIG_MAPPING``: general.*, llama.*, tokenizer.ggml.*_token_id), whether the LM head is
    tied (no output.weight), and the vocabulary's length where the file states no vocab_size."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    config = {"tie_word_embeddings": all(t.name != "output.weight" for t in gguf.tensors)}
    for key, value in gguf.metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is None or renamed == -1:
            continue
        if isinstance(value, list) and len(value) == 1:  # transformers unwraps a one-element array
            value = value[0]
        config[renamed] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in gguf.metadata:
        config["vocab_size"] = len(gguf.metadata["tokenizer.ggml.tokens"])
    return config


def one_pass_plan(gguf_file: Path) -> Optional[OnePassPlan]:
    """The plan for converting ``gguf_file`` in one pass, or None where this module does not cover it
    (the caller then converts with transformers, which also reports unreadable files)."""
    import transformers

    if not hasattr(transformers, "TokenizersBackend") or (gguf_file.parent / "tokenizer_config.json").exists():
        return None
    try:
        gguf = read_gguf(gguf_file)
    except (GgufFormatError, OSError):
        return None
    meta = gguf.metadata
    name = meta.get("general.name")
    if (gguf.architecture != ARCHITECTURE or (name is not None and "mistral" in str(name).lower())
            or f"{ARCHITECTURE}.attention.head_count" not in meta
            or f"{ARCHITECTURE}.attention.head_count_kv" not in meta
            or f"{ARCHITECTURE}.block_count" not in meta):
        return None
    names = {tensor.name: checkpoint_name(tensor.name) for tensor in gguf.tensors}
    config_dict = config_dict_from_metadata(gguf)
    if None in names.values() or set(names.values()) != expected_names(
            meta[f"{ARCHITECTURE}.block_count"], config_dict["tie_word_embeddings"]):
        return None
    return OnePassPlan(gguf, names, config_dict)


def unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """weight [heads * head_dim, K], rows in llama.cpp's rotary-interleaved order (head, d, pair)
    -> the checkpoint's order (head, pair, d), as transformers undoes it."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


def dequantized(tensor: GgufTensor, heads: Optional[int]):
    """The tensor as a float32 torch tensor [*shape], its rows unpermuted by ``heads`` if given."""
    import torch
    from gguf import GGMLQuantizationType, dequantize

    values = dequantize(tensor.data, GGMLQuantizationType(tensor.type_id))  # [rows, K] float32
    values = values.astype(np.float32, copy=False).reshape(tensor.shape)
    if heads is not None:
        values = unpermute_rotary_rows(values, heads)
    return torch.from_numpy(np.array(values, dtype=np.float32, order="C"))  # a writable copy


def convert_llama_gguf(plan: OnePassPlan, gguf_file: Path, out_dir: Path, announce) -> None:
    """Write ``out_dir``'s weights, config.json, generation_config.json and tokenizer files from
    ``plan`` (made by ``one_pass_plan(gguf_file)``). ``announce(text)``: a progress line."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, GenerationConfig, TokenizersBackend

    meta = plan.gguf.metadata
    heads = meta[f"{ARCHITECTURE}.attention.head_count"]
    kv_heads = meta[f"{ARCHITECTURE}.attention.head_count_kv"]
    start = time.monotonic()
    state = {}
    for tensor in tqdm(plan.gguf.tensors, desc="Dequantizing GGUF tensors", unit="tensor"):
        rows_of = {"attn_q": heads, "attn_k": kv_heads}.get(tensor.name.split(".")[-2])
        state[plan.names[tensor.name]] = dequantized(tensor, rows_of)
    save_file(state, str(out_dir / CONVERTED_WEIGHTS), metadata={"format": "pt"})
    weights_seconds = time.monotonic() - start
    del state

    # As AutoConfig.from_pretrained(gguf_file=...) builds it, then as loading the model sets it.
    config = AutoConfig.for_model(**plan.config_dict)
    config.dtype = torch.float32
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))

    # AutoTokenizer's choice for a llama GGUF (no tokenizer class of its own in transformers 5).
    tokenizer = TokenizersBackend.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    max_length = getattr(config, "max_position_embeddings", None)
    if max_length:  # the GGUF tokenizer knows no length limit; the model's is the one that holds
        tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(out_dir))
    announce(f"  {len(plan.gguf.tensors)} tensors dequantized and written in {weights_seconds:.1f} s; "
             f"config and tokenizer in {time.monotonic() - start - weights_seconds:.1f} s.")
