"""``quantization="gguf"``: a Llama-family GGUF file served with its Q4_0 / Q4_1 linear weights
kept packed (the int4 kernel's layout holds both exactly, backend/models/int4_weights.py).

The file is still converted once into a Hugging Face directory (backend/models/conversion.py:
config, tokenizer, chat template, and every tensor dequantized); the model loads that as usual,
then ``attach_packed_weights`` reads the file's quantized tensors and hands each linear layer whose
every source tensor is Q4_0 or Q4_1 its packed form (``layer.gguf_int4``), which
``GgufLinearMethod`` (linear_methods.py) keeps in place of the dequantized weight. Other layers
(other GGUF types, F32/F16 tensors, the embedding) run their dequantized weight in the serving
dtype, as without ``quantization="gguf"``.

llama.cpp stores attn_q and attn_k with their rows in a rotary-interleaved order; transformers puts
them back when converting, and so does this file (rows only: each row's groups are untouched).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from backend.models.int4_weights import int4_from_gguf
from backend.models.linear import LinearBase

logger = logging.getLogger(__name__)

PACKED_TYPES = ("Q4_0", "Q4_1")
MODEL_TYPES = ("llama",)  # GGUF's llama tensor names and q/k row order


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary interleave of a q (or k) weight of ``heads``
    heads: new row (h, half, d) is stored row (h, d, half)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def llama_sources(hf_config, gguf_names: set[str]) -> dict[str, list[tuple[str, Optional[int]]]]:
    """Tandem's linear module name -> its GGUF tensors in row order, each with the head count its
    rows are un-interleaved by (None: kept as stored)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    sources = {}
    for i in range(hf_config.num_hidden_layers):
        prefix, blk = f"model.layers.{i}", f"blk.{i}"
        sources[f"{prefix}.self_attn.qkv_proj"] = [(f"{blk}.attn_q.weight", heads), (f"{blk}.attn_k.weight", kv_heads),
                                                   (f"{blk}.attn_v.weight", None)]
        sources[f"{prefix}.self_attn.o_proj"] = [(f"{blk}.attn_output.weight", None)]
        sources[f"{prefix}.mlp.gate_up_proj"] = [(f"{blk}.ffn_gate.weight", None), (f"{blk}.ffn_up.weight", None)]
        sources[f"{prefix}.mlp.down_proj"] = [(f"{blk}.ffn_down.weight", None)]
    sources["lm_head"] = [("output.weight" if "output.weight" in gguf_names else "token_embd.weight", None)]
    return sources


def check_gguf_model_type(hf_config) -> None:
    if hf_config.model_type not in MODEL_TYPES:
        raise ValueError(f"quantization='gguf' serves Llama-family GGUF files ({', '.join(MODEL_TYPES)}); "
                         f"this one is {hf_config.model_type!r}")


def attach_packed_weights(model: nn.Module, gguf_file: Path, hf_config) -> int:
    """Set ``layer.gguf_int4 = (qweight, scales)`` on each linear layer of ``model`` whose GGUF
    tensors are all Q4_0 / Q4_1; returns how many layers got one."""
    import gguf

    check_gguf_model_type(hf_config)
    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_file)).tensors}
    modules = dict(model.named_modules())
    packed = 0
    for name, sources in llama_sources(hf_config, set(tensors)).items():
        module = modules.get(name)
        parts = [tensors.get(source) for source, _ in sources]
        if not isinstance(module, LinearBase):  # e.g. a layer of another pipeline stage
            continue
        if any(part is None or part.tensor_type.name not in PACKED_TYPES for part in parts):
            continue
        qweights, scales = [], []
        for part, (_, heads) in zip(parts, sources):
            k, n = (int(d) for d in part.shape[:2])  # GGUF lists the row length first
            q, s = int4_from_gguf(part.data, part.tensor_type.name, (n, k))
            if heads is not None:
                order = unpermute_rows(n, heads)
                q, s = q[order], s[order]
            qweights.append(q)
            scales.append(s)
        qweight, scale = torch.cat(qweights).contiguous(), torch.cat(scales).contiguous()
        if tuple(qweight.shape) != (module.weight.shape[0], module.weight.shape[1] // 2):
            raise ValueError(f"{gguf_file.name}: the packed {name} is {tuple(qweight.shape)} bytes; "
                             f"the layer's weight is {tuple(module.weight.shape)}")
        module.gguf_int4 = (qweight, scale)
        packed += 1
    logger.info("quantization='gguf': %d linear layers keep their Q4 tensors packed", packed)
    return packed
