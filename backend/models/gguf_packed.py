"""``quantization="gguf"``: a Llama-family GGUF file served with its Q4_0, Q4_1, Q4_K, Q5_K, Q6_K
and Q8_0 linear weights kept packed: a layer whose tensors are all Q4_0 / Q4_1 in the int4 kernel's
layout (backend/models/int4_weights.py, which holds both exactly), one of Q4_K (and Q4_0 / Q4_1) in
4-bit codes with fp32 scales (int4f), any other mix of the six types in the grouped int8 layout (backend/models/gguf_blocks.py: int8 codes, fp32 (s, m) per 16 weights),
each part decoded by its own type, so a fused qkv or gate_up whose parts differ is a run of rows
per part. A quantized type outside the six is refused, naming it and its tensor. The repack is done
once and saved beside the converted checkpoint (``PACK_CACHE``); later loads map that file. With
``int4_activations="int8"`` the integer kernels' panels are cached the same way (``PANEL_CACHE``).

The file is still converted once into a Hugging Face directory (backend/models/conversion.py:
config, tokenizer, chat template, and every tensor dequantized). Before the model loads it,
``attach_packed_weights`` reads the file's quantized tensors and hands each linear layer whose
every source tensor is packed its packed form (``layer.gguf_int4`` or ``layer.gguf_int8g``), which
``GgufLinearMethod`` (linear_methods.py) keeps in place of the dequantized weight; where the pack
alone serves the layer its weight is marked ``weight_is_packed``, so the load skips its dequantized
tensor unread (for a 1B model, 4 GB of fp32 never paged in, copied or freed). Other layers
(F32/F16/BF16 tensors, the embedding) load and run their dequantized weight in the serving dtype,
as without ``quantization="gguf"``.

llama.cpp stores attn_q and attn_k with their rows in a rotary-interleaved order; transformers puts
them back when converting, and so does this file (rows only: each row's groups are untouched).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

import tandem_kernels.cpu

from backend.models.gguf_blocks import INT4F_TYPES, int4f_from_gguf, int8g_from_gguf
from backend.models.gguf_file import read_gguf
from backend.models.huge_pages import copies_in_one_arena, huge_pages_enabled
from backend.models.int4_weights import int4_from_gguf
from backend.models.linear import LinearBase
from backend.models.linear_methods import int8_activation_panels

logger = logging.getLogger(__name__)

INT4_TYPES = ("Q4_0", "Q4_1")  # served by the int4 kernel when a layer is all of these
PACKED_TYPES = (*INT4_TYPES, "Q4_K", "Q5_K", "Q6_K", "Q8_0")
PLAIN_TYPES = ("F32", "F16", "BF16", "F64")  # dequantized (converted) like any checkpoint
PACK_CACHE = "tandem-gguf-packed-v2.pt"  # in the converted checkpoint's directory
PANEL_CACHE = "tandem-gguf-int8-panels-v1.pt"  # beside it: the panels for int4_activations="int8"
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


def pack_tensors(gguf_file: Path, hf_config) -> dict[str, tuple]:
    """Every packable linear module's packed form: name -> ("int4" | "int4f", qweight, scales) or
    ("int8g", codes, scales), in Tandem's row order, the file's header read by ``gguf_file.read_gguf``.
    Raises ValueError naming a quantized tensor of a type outside PACKED_TYPES (``GgufFormatError``,
    a ValueError, for one gguf does not know)."""
    from gguf import GGMLQuantizationType

    tensors = {t.name: t for t in read_gguf(gguf_file).tensors}
    packs = {}
    for name, sources in llama_sources(hf_config, set(tensors)).items():
        parts = [tensors.get(source) for source, _ in sources]
        kinds = [GGMLQuantizationType(part.type_id).name if part is not None else None for part in parts]
        for part, kind in zip(parts, kinds):
            if kind is not None and kind not in PACKED_TYPES + PLAIN_TYPES:
                raise ValueError(f"{gguf_file.name}: tensor {part.name} is GGUF type {kind}; quantization='gguf' "
                                 f"serves {', '.join(PACKED_TYPES)} packed and {', '.join(PLAIN_TYPES)} plain")
        if any(kind not in PACKED_TYPES for kind in kinds):
            continue
        layout = ("int4" if all(kind in INT4_TYPES for kind in kinds) else
                  "int4f" if all(kind in INT4F_TYPES for kind in kinds) else "int8g")
        decode = {"int4": int4_from_gguf, "int4f": int4f_from_gguf, "int8g": int8g_from_gguf}[layout]
        codes, scales = [], []
        for part, kind, (_, heads) in zip(parts, kinds, sources):
            n, k = part.shape  # rows first; a linear weight is 2-D
            q, s = decode(part.data, kind, (n, k))
            if heads is not None:
                order = unpermute_rows(n, heads)
                q, s = q[order], s[order]
            codes.append(q)
            scales.append(s)
        packs[name] = (layout, torch.cat(codes).contiguous(), torch.cat(scales).contiguous())
    return packs


def _mapped_cache(cache: Optional[Path], build: Callable[[], dict]) -> dict:
    """``build()``, saved once at ``cache`` (when given) and memory-mapped from there on later loads
    (``attach_packed_weights`` copies what the layers keep out of the mapping)."""
    if cache is not None and cache.is_file():
        return torch.load(cache, mmap=True, weights_only=True)
    built = build()
    if cache is not None:
        partial = cache.with_suffix(f".partial-{os.getpid()}")
        torch.save(built, partial)
        os.replace(partial, cache)
    return built


def cached_packs(gguf_file: Path, hf_config, cache_dir: Optional[Path]) -> dict[str, tuple]:
    """``pack_tensors``, saved once under ``cache_dir`` (the converted checkpoint's directory, keyed
    by the file) and memory-mapped from there on later loads."""
    return _mapped_cache(cache_dir / PACK_CACHE if cache_dir is not None else None,
                         lambda: pack_tensors(gguf_file, hf_config))


def cached_panels(packs: dict[str, tuple], cache_dir: Optional[Path]) -> dict[str, tuple]:
    """``int4_activations="int8"``'s form of ``cached_packs``' result: name -> the panels its integer
    kernel reads (``int8_activation_panels``), for every pack that kernel takes, saved once beside
    the packs and memory-mapped on later loads (no repack at start-up)."""
    def build() -> dict[str, tuple]:
        panels = {name: int8_activation_panels(*pack) for name, pack in packs.items()}
        return {name: form for name, form in panels.items() if form is not None}

    return _mapped_cache(cache_dir / PANEL_CACHE if cache_dir is not None else None, build)


def pack_replaces_weight(layer: LinearBase, layout: str) -> bool:
    """Whether ``GgufLinearMethod`` runs ``layer`` from its ``layout`` pack alone, so its dequantized
    weight need not be loaded: not where the weight is shared (a tied LM head keeps the embedding's)
    nor for an int8g pack off the CPU (no GPU kernel: the method runs the loaded weight instead)."""
    return not getattr(layer, "weight_is_shared", False) and (layout != "int8g" or layer.weight.device.type == "cpu")


def attach_packed_weights(model: nn.Module, gguf_file: Path, hf_config, cache_dir: Optional[Path] = None,
                          int8_panels: bool = False) -> int:
    """Set ``layer.gguf_int4`` / ``gguf_int4f`` / ``gguf_int8g`` = (codes, scales) on each
    linear layer of ``model`` whose GGUF tensors are all of PACKED_TYPES, and mark its weight
    ``weight_is_packed`` where the pack replaces it (``pack_replaces_weight``); call it before
    ``model.load_weights``, which then skips those weights. With ``int8_panels`` (int8 activations,
    the fused CPU kernels loaded) a layer whose integer kernel takes its pack gets ``layer.gguf_panels``
    (``cached_panels``') instead. Returns how many layers got a pack.

    Where a cache was read from its file (a mapping, on 4 KB page-cache pages) and the system has
    2 MB pages, what CPU layers keep of it is copied into one arena on 2 MB pages
    (``copies_in_one_arena``): batch-1 decode of a 1B file ~10 % (Q4_K_M) to ~30 % (Q4_1) faster on
    a 2-core AMD EPYC, for 1-2 s more start-up; each process then holds its own copy, as it does
    of any other model's weights."""
    check_gguf_model_type(hf_config)
    modules = dict(model.named_modules())
    from_files = [*(PANEL_ATTRIBUTES if _cache_file(cache_dir, PANEL_CACHE) else ()),
                  *(PACK_ATTRIBUTES if _cache_file(cache_dir, PACK_CACHE) else ())]  # read, not built
    packs = cached_packs(gguf_file, hf_config, cache_dir)
    panels = cached_panels(packs, cache_dir) if int8_panels and tandem_kernels.cpu.available() else {}
    packed = 0
    for name, (layout, codes, scales) in packs.items():
        module = modules.get(name)
        if not isinstance(module, LinearBase):  # e.g. a layer of another pipeline stage
            continue
        width = codes.shape[1] * (1 if layout == "int8g" else 2)
        if (codes.shape[0], width) != tuple(module.weight.shape):
            raise ValueError(f"{gguf_file.name}: the packed {name} holds {codes.shape[0]} x {width} weights; "
                             f"the layer's weight is {tuple(module.weight.shape)}")
        if name in panels and module.weight.device.type == "cpu":
            module.gguf_panels = panels[name]
        else:
            setattr(module, f"gguf_{layout}", (codes, scales))
        if pack_replaces_weight(module, layout):
            module.weight_is_packed = True
        packed += 1
    if huge_pages_enabled():
        _copy_cpu_packs_out_of_mappings(modules.values(), from_files)
    logger.info("quantization='gguf': %d linear layers keep their quantized tensors packed", packed)
    return packed


PANEL_ATTRIBUTES = ("gguf_panels",)  # where attach_packed_weights puts what each cache gives a layer
PACK_ATTRIBUTES = ("gguf_int4", "gguf_int4f", "gguf_int8g")


def _cache_file(cache_dir: Optional[Path], name: str) -> bool:
    """Whether the cache ``name`` is on disk, so that ``_mapped_cache`` maps it rather than builds it."""
    return cache_dir is not None and (cache_dir / name).is_file()


def _copy_cpu_packs_out_of_mappings(modules, attributes: list[str]) -> None:
    """Replace the tensors of every CPU layer's ``attributes`` (packs or panels, from a mapped
    cache) with copies in one huge-page arena; the tuples keep their other items (layout names, N)."""
    held = [(m, name) for m in modules if isinstance(m, LinearBase) and m.weight.device.type == "cpu"
            for name in attributes if hasattr(m, name)]
    tensors = [t for m, name in held for t in getattr(m, name) if torch.is_tensor(t)]
    if not tensors:
        return
    copies = iter(copies_in_one_arena(tensors))
    for m, name in held:
        setattr(m, name, tuple(next(copies) if torch.is_tensor(t) else t for t in getattr(m, name)))
