"""``quantization="awq"`` / ``"gptq"``: Hugging Face checkpoints whose linear layers are stored as
AWQ (GEMM version) or GPTQ 4-bit tensors, served by the CPU's int4 kernels without changing a value.

A quantized linear ``P`` (e.g. ``model.layers.0.self_attn.q_proj``) with K inputs, N outputs and
groups of ``gs`` inputs (gs = -1 in GPTQ: one group over all K) is stored as three tensors:

    AWQ   P.qweight [K, N / 8] int32   P.qzeros [K / gs, N / 8] int32   P.scales [K / gs, N] fp16
          8 codes an int32 along N, nibble i (bits 4i..4i+3) holding column 8c + AWQ_ORDER[i]
          (AWQ_ORDER = 0 2 4 6 1 3 5 7); the zeros packed the same way; w = (q - z) s
    GPTQ  P.qweight [K / 8, N] int32   P.qzeros [K / gs, N / 8] int32   P.scales [K / gs, N] fp16
          (+ P.g_idx [K] int32, k // gs when desc_act is off)
          qweight's nibble j of row i is input 8i + j; qzeros' nibble j of column c is output
          8c + j and holds z - 1 (the "gptq" checkpoint format's offset); w = (q - z) s

Each layer becomes the CPU kernel's form, 4-bit codes in int4_linear's nibble order with one
(d, m) pair per row and 32-wide group (a gs-wide group is gs / 32 groups of the same pair):
d = s, m = -s z. In fp32 both are exact (s has 11 significant bits, z 5), and d q + m = s (q - z)
is exact as well, so the kernel's weight is the format's value bit for bit:

    int4   fp16 (d, m) (int4_weights.py; 5 bits a weight) when every m is an fp16 value, as with
           GPTQ's symmetric z = 8
    int4f  fp32 (d, m) (gguf_reference.int4f_dequantize; 6 bits a weight) otherwise: -s z often
           needs more than fp16's 11 bits (s = 1 + 2^-10, z = 3)

``attach_checkpoint_packs`` takes the checkpoint's tensors before the model loads them, hands
each quantized layer (a fused qkv / gate_up from its parts, in shard order) its packed form as
``GgufLinearMethod`` reads it (``layer.gguf_int4`` / ``layer.gguf_int4f``), marks its weight
``weight_is_packed`` (never loaded, never touched, so never resident) and passes the other
tensors on. On CUDA both forms run the Triton dequant-GEMM (tandem_kernels.int4_matmul); the packs are
copied to the device by ``GgufLinearMethod``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from backend.models.int4_weights import GROUP, pack_nibbles
from backend.models.linear import LinearBase

logger = logging.getLogger(__name__)

METHODS = ("awq", "gptq")
MODEL_TYPES = ("llama", "mistral", "qwen2")  # LlamaForCausalLM's weight names (backend/models/llama.py)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its 8
QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
_FP16_MAX = 65504.0


class QuantizationConfigError(ValueError):
    """A checkpoint's ``quantization_config`` asks for something Tandem does not serve."""


def quantization_config(hf_config: Any) -> Optional[dict]:
    """The config.json's ``quantization_config`` as a dict, or None."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict()


def checkpoint_method(hf_config: Any) -> Optional[str]:
    """"awq" or "gptq" for a checkpoint this module serves, None for one without a
    ``quantization_config``; QuantizationConfigError naming anything else (another method, bits,
    version, desc_act, ...)."""
    qc = quantization_config(hf_config)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise QuantizationConfigError(
            f"the checkpoint's quantization_config has quant_method={qc.get('quant_method')!r}; "
            f"Tandem serves quantized checkpoints of {', '.join(METHODS)} only")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise QuantizationConfigError(f"{method} with bits={bits!r}: Tandem serves 4-bit {method} only")
    group_size(qc)
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationConfigError(f"awq version={qc.get('version')!r}: Tandem reads the GEMM packing only")
        if qc.get("zero_point", True) is not True:
            raise QuantizationConfigError("awq with zero_point=false: Tandem serves AWQ with zero points only")
        if str(qc.get("backend", "autoawq")).lower() != "autoawq":
            raise QuantizationConfigError(f"awq backend={qc.get('backend')!r}: Tandem reads AutoAWQ's packing only")
    else:
        if qc.get("desc_act"):
            raise QuantizationConfigError("gptq with desc_act=true (act-order): Tandem serves desc_act=false only")
        checkpoint_format = str(qc.get("checkpoint_format", "gptq")).lower()
        if checkpoint_format != "gptq":
            raise QuantizationConfigError(f"gptq checkpoint_format={qc.get('checkpoint_format')!r}: "
                                          "Tandem reads the 'gptq' format only")
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise QuantizationConfigError(f"quantization={method!r} serves Llama-family models "
                                      f"({', '.join(MODEL_TYPES)}); this one is {model_type!r}")
    return method


def group_size(qc: dict) -> int:
    """The config's group size: a positive multiple of 32, or -1 (one group over all inputs)."""
    size = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(size, int) or not (size == -1 or (size > 0 and size % GROUP == 0)):
        raise QuantizationConfigError(f"{qc.get('quant_method')} with group_size={size!r}: Tandem serves "
                                      f"groups of a multiple of {GROUP} inputs (or -1)")
    return size


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> uint8 [..., C, 8]: nibble i (bits 4i..4i+3) at index i. Read as bytes
    (little endian, as the safetensors data is): byte b holds nibbles 2b (low) and 2b + 1 (high)."""
    raw = packed.to(torch.int32).contiguous().reshape(-1).view(torch.uint8).view(*packed.shape, 4)  # [..., C, 4]
    return torch.stack([raw & 15, raw >> 4], dim=-1).view(*packed.shape, 8)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, C] -> uint8 [8 C, R]: column 8c + j's codes in row 8c + j. The words are
    transposed first (8 codes move at once), then read as bytes (little endian: nibble i is byte
    i // 2's low or high half), so that every pass below runs along R."""
    rows, words = packed.shape
    raw = packed.to(torch.int32).t().contiguous().reshape(-1).view(torch.uint8).view(words, rows, 4)  # [C, R, 4]
    out = torch.empty(words, 8, rows, dtype=torch.uint8)
    for j in range(8):
        nibble = AWQ_ORDER.index(j)
        byte = raw[..., nibble // 2]  # [C, R]
        if nibble % 2:
            torch.bitwise_right_shift(byte, 4, out=out[:, j])
        else:
            torch.bitwise_and(byte, 15, out=out[:, j])
    return out.view(-1, rows)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ GEMM qweight [K, N / 8], qzeros [G, N / 8] int32 -> (codes [N, K], zeros [N, G]) uint8."""
    return _awq_columns(qweight), _awq_columns(qzeros)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ qweight [K / 8, N], qzeros [G, N / 8] int32 -> (codes [N, K] uint8, zeros [N, G] uint8,
    1..16: the stored z - 1, plus 1)."""
    codes = _nibbles(qweight.t()).view(qweight.shape[1], -1)  # [N, K]: input 8i + j at [n, 8i + j]
    zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1) + 1  # [G, N]
    return codes.contiguous(), zeros.t().contiguous()


def to_kernel_layout(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] uint8, zeros [N, G] uint8, scales [N, G] fp16 (K / G a multiple of 32) ->
    (qweight [N, K / 2] uint8 in int4_linear's nibble order, (d, m) [N, K / 32, 2] fp32 with d = s,
    m = -s z, exact), the gs-wide groups repeated as 32-wide ones."""
    n, k = codes.shape
    repeat = k // zeros.shape[1] // GROUP
    d = scales.float().repeat_interleave(repeat, dim=1)  # [N, K / 32]
    m = -(d * zeros.float().repeat_interleave(repeat, dim=1))
    return pack_nibbles(codes.view(n, k // GROUP, GROUP)), torch.stack([d, m], dim=2).contiguous()


def narrowest(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor]:
    """("int4", qweight, fp16 scales) when every (d, m) is an fp16 value, else ("int4f", qweight,
    fp32 scales): the same weights either way."""
    half = scales.clamp(-_FP16_MAX, _FP16_MAX).half()
    if torch.equal(half.float(), scales):
        return "int4", qweight, half.contiguous()
    return "int4f", qweight, scales


def dequantize_layer(method: str, name: str, tensors: dict[str, torch.Tensor], group: int,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One checkpoint layer's tensors (qweight, qzeros, scales[, g_idx]) -> ``to_kernel_layout``'s
    pair. ValueError naming the tensor for a missing or misshapen one, or a g_idx other than
    k // group_size."""
    for suffix in ("qweight", "qzeros", "scales"):
        if suffix not in tensors:
            raise ValueError(f"{method} checkpoint: {name}.{suffix} is missing")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    unpack = unpack_awq if method == "awq" else unpack_gptq
    codes, zeros = unpack(qweight, qzeros)
    n, k = codes.shape
    groups = 1 if group == -1 else k // group
    if k % GROUP or (group != -1 and k % group) or tuple(scales.shape) != (groups, n) \
            or tuple(zeros.shape) != (n, groups) or scales.dtype != torch.float16:
        raise ValueError(f"{method} checkpoint: {name} holds qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)} {scales.dtype}, which do not make "
                         f"a {n} x {k} layer of {group}-wide groups with fp16 scales")
    if "g_idx" in tensors:
        expected = torch.arange(k, dtype=torch.int64) // (k if group == -1 else group)
        if not torch.equal(tensors["g_idx"].to(torch.int64), expected):
            raise ValueError(f"gptq checkpoint: {name}.g_idx is not k // group_size (an act-order layout); "
                             "Tandem serves desc_act=false checkpoints only")
    return to_kernel_layout(codes, zeros, scales.t().contiguous())


def split_checkpoint(weights: Iterable[tuple[str, torch.Tensor]],
                     ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
    """(the plain tensors, layer name -> its quantized tensors by suffix). Tensors stay views of
    the mapped files; nothing is read here."""
    plain, quantized = [], {}
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        if suffix in QUANTIZED_SUFFIXES:
            quantized.setdefault(prefix, {})[suffix] = tensor
        else:
            plain.append((name, tensor))
    orphans = [name for name, parts in quantized.items() if "qweight" not in parts]
    for prefix in orphans:  # e.g. a layer's own "scales" parameter: not a quantized linear
        plain += [(f"{prefix}.{suffix}", tensor) for suffix, tensor in quantized.pop(prefix).items()]
    return plain, quantized


def attach_checkpoint_packs(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], method: str,
                            hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Pack every quantized layer of the checkpoint into the model's linear layers (see the module
    docstring); returns the plain tensors, for ``model.load_weights``. ValueError naming the layer
    when a fused layer has quantized and plain parts, or a packed layer's shape differs."""
    group = group_size(quantization_config(hf_config))
    plain, quantized = split_checkpoint(weights)
    stacked = getattr(model, "stacked_params", {})
    modules = dict(model.named_modules())
    parts: dict[str, dict[int, tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for name, tensors in quantized.items():
        target, shard = name, 0
        for fragment, (fused, shard_id) in stacked.items():
            if name.endswith(f".{fragment}"):
                target, shard = name[: -len(fragment)] + fused, shard_id
                break
        if not isinstance(modules.get(target), LinearBase):
            raise ValueError(f"{method} checkpoint: {name} matches no linear layer of {type(model).__name__}")
        parts.setdefault(target, {})[shard] = (name, *dequantize_layer(method, name, tensors, group))
    for target, shards in parts.items():
        layer = modules[target]
        wanted = getattr(layer, "shard_ids", None) or (0,)
        if sorted(shards) != sorted(wanted):
            raise ValueError(f"{method} checkpoint: {target} is fused from parts of which only "
                             f"{', '.join(shards[i][0] for i in sorted(shards))} are quantized")
        if getattr(layer, "weight_is_shared", False):
            raise ValueError(f"{method} checkpoint: {target} is quantized but shares its weight (a tied LM head)")
        qweight = torch.cat([shards[i][1] for i in sorted(shards)])
        scales = torch.cat([shards[i][2] for i in sorted(shards)])
        if (qweight.shape[0], qweight.shape[1] * 2) != tuple(layer.weight.shape):
            raise ValueError(f"{method} checkpoint: {target} holds {qweight.shape[0]} x {qweight.shape[1] * 2} "
                             f"weights; the layer's weight is {tuple(layer.weight.shape)}")
        layout, qweight, scales = narrowest(qweight, scales)
        setattr(layer, f"gguf_{layout}", (qweight, scales))
        layer.weight_is_packed = True
    logger.info("quantization=%r: %d linear layers served packed", method, len(parts))
    return iter(plain)
