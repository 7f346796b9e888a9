"""How linear layers multiply on each device: the ``LinearMethod``s, and the choice of one.

    LinearMethod (linear.py)  F.linear on the weight as loaded: CUDA, and any other device
    OneDnnLinearMethod        CPU, fp32/bf16: the weight reordered once into oneDNN's blocked
                              layout. Same math as F.linear, which on x86 CPUs goes to MKL: on AMD
                              CPUs MKL is 1.6-3x slower at decode batch sizes (bench/ceiling.py)
    AmxLinearMethod           CPU with AMX, bf16: the weight packed once into AMX tiles
                              (kernels/tandem_kernels/csrc/amx_linear.cpp). F.linear's math (exact products, fp32
                              sums, one rounding); a batch-32 decode step's matmuls 1.35-1.5x
                              faster than oneDNN's (which runs on AMX too), prompts' 0.74-1.09x;
                              an MLP's gate | up with its SiLU in the epilogue (``apply_gated``)
    Bf16DotLinearMethod       CPU with AVX-512 BF16 and no AMX (AMD Zen 4+), bf16: the weight packed
                              once into 64-column blocks (csrc/bf16_linear.cpp), multiplied with
                              vdpbf16ps: F.linear's math (exact products, fp32 sums, one rounding),
                              batch-invariant; an MLP's gate | up with its SiLU in the epilogue, as
                              AMX's. One core streamed a batch-1 step's weights at 23-28 GB/s where
                              oneDNN's kernel did 14; at 8-512 rows 1.05-1.45x oneDNN's
    Int8LinearMethod          CPU, ``quantization="int8"``: weight-only int8, one symmetric scale
                              per output channel; activations in the model's dtype (fp32 or
                              bf16), summed in fp32: the matmul with the dequantized weight
                              (tandem_kernels.reference.int8_linear). In bf16 with AVX-512 BF16
                              the weight is packed once into 16-column panels, converted to bf16
                              a panel pair at a time in cache, and multiplied with vdpbf16ps
                              (csrc/int8_bf16.cpp); in fp32, float multiply-adds, fast at batch
                              1 only (2-5x slower than bf16's matmul at many rows)
    W8A8LinearMethod          CPU, ``quantization="w8a8"``: the same int8 weights; activations
                              quantized per row and 32-wide block on the fly, products summed
                              exactly in int32 (tandem_kernels.reference.w8a8_linear), results in
                              the model's dtype. The weight is packed once into 16-column panels
                              (csrc/w8a8_packed.cpp: one vector lane per output column; vpdpbusd
                              with AVX-512 VNNI, where the matmuls run faster than bf16's at every
                              row count measured (1-128: ~3x at batch 1, ~1.5x at 32 and more on an
                              AMD EPYC without AMX); vpmaddubsw on AVX2).
                              Approximate: no float model computes the same.
    Int4LinearMethod          CPU and CUDA, ``quantization="int4"``: 4-bit weights, round to nearest per row
                              and 32-wide group, asymmetric (GGUF Q4_1's form: fp16 d and m, 5 bits
                              a weight; backend/models/int4_weights.py); fp32 or bf16 activations
                              (kernels/tandem_kernels/csrc/int4_linear.cpp): the matmul with the
                              dequantized weight (rounded to bf16 for bf16 activations: exact
                              products, vdpbf16ps where the CPU has it), summed in fp32, rounded once;
                              on CUDA bf16 or fp16 activations, the Triton dequant-GEMM
                              (kernels/tandem_kernels/int4_matmul.py: same contract; compiled for
                              sm_80 / sm_90a in CI, not yet run on a GPU). With
                              ``int4_activations="int8"`` (CPU) the activations are quantized to
                              8 bits per 32 values and the products are integer dot products
                              (csrc/int4_q8.cpp, as llama.cpp runs its 4-bit GGUF types), on the
                              weights repacked once at load into 8-column panels: faster on
                              AVX2, approximate
    GgufLinearMethod          CPU, ``quantization="gguf"``: a GGUF file's Q4_0 / Q4_1 weights kept
                              packed for the int4 kernel, its Q4_K layers as 4-bit codes with fp32
                              scales, Q5_K / Q6_K / Q8_0 (and mixed) layers in a grouped int8
                              layout (csrc/gguf_linear.cpp; with int8 activations the layers
                              whose codes fit 6 bits, Q5_K / Q6_K, csrc/int8g_q8.cpp)
                              (backend/models/gguf_packed.py); every other layer runs its
                              dequantized weight with the dtype's method; also
                              ``quantization="awq"`` / ``"gptq"``: a checkpoint's AWQ / GPTQ 4-bit
                              layers repacked exactly into the int4 / int4f forms
                              (backend/models/int4_checkpoints.py). On CUDA the int4 / int4f
                              layers run the Triton kernel; int8g layers their dequantized weight

oneDNN keeps every primitive it creates, one per (weight shape, row count), in two caches (its
own and ideep's), 1,024 entries each by default and ~1 MB per entry here: under traffic whose
batch row counts keep changing, a process grew by ~1 GB before they filled. The first
``OneDnnLinearMethod`` bounds both (``ONEDNN_CACHE_CAPACITY`` entries; an explicit
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` / ``LRU_CACHE_CAPACITY`` in the environment wins). Both are
read at the process's first oneDNN call, which is the first weight reorder.

A method's ``process_weights_after_loading`` replaces the layer's loaded weight by its own form
(the plain weight is then freed unless another module shares it, as a tied LM head does).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

import tandem_kernels.cpu
from tandem_kernels import gguf_reference
from tandem_kernels import ops as kernels
from backend.models.int4_weights import quantize_int4
from backend.models.linear import LinearBase, LinearMethod
from backend.types.config import INT4_QUANTIZATIONS


# Entries in each oneDNN cache: a step uses ~5 linear shapes at its row count (layers of one
# shape share primitives), so this keeps ~12 row counts; a miss costs ~1 ms (bench on issue 10).
ONEDNN_CACHE_CAPACITY = 64


class OneDnnLinearMethod(LinearMethod):
    # oneDNN picks its blocking for this batch size; measured best across batches 2..128 here.
    BATCH_HINT = 32

    def __init__(self) -> None:
        bound_onednn_caches()

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), self.BATCH_HINT)
        release_weight(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")


class _PanelPackedLinearMethod(LinearMethod):
    """Tandem's bf16 kernels on a weight packed once (``_pack``); the layer keeps only the packed
    weight (``packed_weight``). A gate | up pair (halves of a multiple of 32 features, no bias) is
    packed with its 32-row panels alternating (``tandem_kernels.cpu.amx_gated_order``), so that
    ``apply_gated`` computes SiLU(gate) * up in the matmul's epilogue (``_gated_linear``): the
    gate | up product is never written out and read back by a separate SiLU pass."""

    _pack = _linear = _gated_linear = None  # the kernels, set by each subclass

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        weight = layer.weight.detach()
        half = getattr(layer, "gated_half", None)
        layer.packed_gated_half = half if half and half % 32 == 0 and layer.bias is None else None
        if layer.packed_gated_half:
            weight = weight[tandem_kernels.cpu.amx_gated_order(layer.packed_gated_half)]
        layer.packed_weight = type(self)._pack(weight)
        layer.packed_out_features = layer.weight.shape[0]
        release_weight(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = type(self)._linear(rows, layer.packed_weight, layer.packed_out_features, bias)
        if layer.packed_gated_half:  # columns in panel order: back to gate | up
            out = out.view(-1, layer.packed_gated_half // 32, 2, 32).transpose(1, 2).reshape(out.shape)
        return out.view(*x.shape[:-1], layer.packed_out_features)

    def apply_gated(self, layer: LinearBase, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if not layer.packed_gated_half:
            return super().apply_gated(layer, x, bias)
        return type(self)._gated_linear(x, layer.packed_weight, layer.packed_gated_half)


class AmxLinearMethod(_PanelPackedLinearMethod):
    """bf16 on AMX tiles (``tandem_kernels.cpu.amx_linear`` / ``amx_gated_linear``)."""

    _pack = staticmethod(lambda weight: tandem_kernels.cpu.amx_pack_weight(weight))
    _linear = staticmethod(lambda *args: tandem_kernels.cpu.amx_linear(*args))
    _gated_linear = staticmethod(lambda *args: tandem_kernels.cpu.amx_gated_linear(*args))


class Bf16DotLinearMethod(_PanelPackedLinearMethod):
    """bf16 on AVX-512 BF16 dot products, for CPUs without AMX (``tandem_kernels.cpu.bf16_dot_linear``
    / ``bf16_dot_gated_linear``; the weight in 64-column blocks, ``bf16_pack_weight``)."""

    _pack = staticmethod(lambda weight: tandem_kernels.cpu.bf16_pack_weight(weight))
    _linear = staticmethod(lambda *args: tandem_kernels.cpu.bf16_dot_linear(*args))
    _gated_linear = staticmethod(lambda *args: tandem_kernels.cpu.bf16_dot_gated_linear(*args))


class Int8LinearMethod(LinearMethod):
    """In bf16 on a CPU with AVX-512 BF16 the layer keeps only the packed weight (``int8_packed``),
    else the plain ``int8_weight``; both give ``tandem_kernels.reference.int8_linear``'s result."""
    name = "int8"

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if not tandem_kernels.cpu.available():
            raise RuntimeError(f"quantization={self.name!r} needs the fused CPU kernels: "
                               f"{tandem_kernels.cpu.unavailable_reason()}")
        dtype = layer.weight.dtype
        layer.int8_weight, layer.weight_scale = quantize_int8(layer.weight.detach().float())
        release_weight(layer)
        self.pack(layer, dtype)

    def pack(self, layer: LinearBase, dtype: torch.dtype) -> None:
        """Replace ``layer.int8_weight`` by the form this CPU's fastest kernel reads, if any."""
        layer.int8_packed = None
        if dtype == torch.bfloat16 and tandem_kernels.cpu.int8_bf16_available():
            layer.int8_packed = tandem_kernels.cpu.int8_pack_weight_bf16(layer.int8_weight)
            del layer.int8_weight

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if layer.int8_packed is not None:
            return tandem_kernels.cpu.int8_linear_packed(x, layer.int8_packed, layer.weight_scale, bias)
        return tandem_kernels.cpu.int8_linear(x, layer.int8_weight, layer.weight_scale, bias)


class W8A8LinearMethod(Int8LinearMethod):
    """The layer keeps only the packed weight (``w8a8_packed``), which gives
    ``tandem_kernels.reference.w8a8_linear``'s result."""
    name = "w8a8"

    def pack(self, layer: LinearBase, dtype: torch.dtype) -> None:
        layer.w8a8_packed = tandem_kernels.cpu.w8a8_pack_weight(layer.int8_weight)
        del layer.int8_weight

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return tandem_kernels.cpu.w8a8_linear_packed(x, layer.w8a8_packed, layer.weight_scale, bias)


class Int4LinearMethod(LinearMethod):
    """The int4 layout (and int4f, its fp32-scale form) on the device the layer's weight is on:
    ``tandem_kernels.ops.int4_linear`` (the C++ kernels on a CPU, the Triton dequant-GEMM on CUDA),
    or with ``int8_activations`` (CPU) ``tandem_kernels.ops.int4_q8_linear`` on the same weights
    repacked once as its panels (``int4_q8_panels``: codes, scales, N)."""
    name = "int4"

    def __init__(self, int8_activations: bool = False) -> None:
        self.int8_activations = int8_activations

    def _hold_panels(self, layer: LinearBase, layout: str, codes: torch.Tensor, scales: torch.Tensor) -> bool:
        """With int8 activations, keep a 4-bit or int8g pack as the integer kernel's panels
        (``int4_q8_panels`` / ``int8g_q8_panels``: codes, scales, N) and release the loaded weight;
        return whether it did (else the caller keeps the pack as it is)."""
        panels = int8_activation_panels(layout, codes, scales) if self.int8_activations else None
        if panels is None:
            return False
        hold_panels(layer, panels)
        return True

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        require_int4_kernels(self.name, layer.weight.device)
        qweight, scales = quantize_int4(layer.weight.detach())
        if not self._hold_panels(layer, "int4", qweight, scales):
            layer.int4_weight, layer.int4_scales = qweight, scales
            release_weight(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if hasattr(layer, "int4_q8_panels"):
            return kernels.int4_q8_linear(x, *layer.int4_q8_panels, bias)
        return kernels.int4_linear(x, layer.int4_weight, layer.int4_scales, bias)


class GgufLinearMethod(Int4LinearMethod):
    name = "gguf"

    def __init__(self, unpacked: LinearMethod, int8_activations: bool = False) -> None:
        super().__init__(int8_activations)
        self.unpacked = unpacked  # for the layers the file does not hold as Q4_0 / Q4_1

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """The packs (CPU tensors: the checkpoint's, or the GGUF repack cache's) move to the
        layer's device. On CUDA an int8g layer (GGUF Q5_K / Q6_K / Q8_0 parts; no GPU kernel for
        that layout yet) drops its pack and runs the weight loaded beside it, dequantized."""
        device = layer.weight.device
        if hasattr(layer, "gguf_panels"):  # int8 activations: the panels, from the GGUF repack cache
            hold_panels(layer, layer.gguf_panels)
            del layer.gguf_panels
            return
        packed = getattr(layer, "gguf_int4", None)
        for layout in ("int8g", "int4f"):
            pack = getattr(layer, f"gguf_{layout}", None)
            if pack is None:
                continue
            delattr(layer, f"gguf_{layout}")
            if layout == "int8g" and device.type != "cpu":
                break
            if layout == "int4f":
                require_int4_kernels(self.name, device)
            if self._hold_panels(layer, layout, *pack):
                return
            layer.gguf_layout, (layer.gguf_codes, layer.gguf_scales) = layout, tuple(t.to(device) for t in pack)
            release_weight(layer)
            return
        if packed is None:
            self.unpacked.process_weights_after_loading(layer)
            return
        require_int4_kernels(self.name, device)
        del layer.gguf_int4
        if not self._hold_panels(layer, "int4", *packed):
            layer.int4_weight, layer.int4_scales = (t.to(device) for t in packed)
            release_weight(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if hasattr(layer, "int8g_q8_panels"):
            return tandem_kernels.cpu.int8g_q8_linear(x, *layer.int8g_q8_panels, bias)
        if hasattr(layer, "gguf_codes"):
            if layer.gguf_layout == "int4f":
                return kernels.int4_linear(x, layer.gguf_codes, layer.gguf_scales, bias)
            return tandem_kernels.cpu.gguf_int8g_linear(x, layer.gguf_codes, layer.gguf_scales, bias)
        if runs_4bit_kernel(layer):
            return super().apply(layer, x, bias)
        return self.unpacked.apply(layer, x, bias)

    def apply_gated(self, layer: LinearBase, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if runs_4bit_kernel(layer) or hasattr(layer, "gguf_codes") or hasattr(layer, "int8g_q8_panels"):
            return super().apply_gated(layer, x, bias)
        return self.unpacked.apply_gated(layer, x, bias)


QUANTIZED_METHODS = {"int8": Int8LinearMethod, "w8a8": W8A8LinearMethod, "int4": Int4LinearMethod}
# Served on CUDA too: the int4 layout's Triton kernel (tandem_kernels.int4_matmul).
GPU_QUANTIZATIONS = ("int4", "gguf", "awq", "gptq")


def require_int4_kernels(name: str, device: torch.device) -> None:
    """On a CPU the int4 kernels are the fused C++ ones: refuse where they do not build. CUDA's
    Triton kernel needs nothing here (and a CUDA process must not build the C++ ones)."""
    if device.type == "cpu" and not tandem_kernels.cpu.available():
        raise RuntimeError(f"quantization={name!r} needs the fused CPU kernels: "
                           f"{tandem_kernels.cpu.unavailable_reason()}")


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Bound oneDNN's primitive cache and ideep's LRU cache, unless the environment already does;
    takes effect only before the process's first oneDNN call."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (int8 [N, K], scale [N] fp32): symmetric, per output channel,
    round to nearest; weight ≈ int8 * scale[:, None]."""
    scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [N]
    q = torch.round(weight / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.float().contiguous()


def runs_4bit_kernel(module: torch.nn.Module) -> bool:
    """Whether a linear layer runs the 4-bit kernels (the int4 or int4f layout), so
    ``int4_activations`` applies to it."""
    return (hasattr(module, "int4_weight") or hasattr(module, "int4_q8_panels")
            or getattr(module, "gguf_layout", None) == "int4f")


def fp16_scales_if_finite(scales: torch.Tensor) -> torch.Tensor:
    """int4f's fp32 (d, m) [N, G, 2] as fp16 for the int8-activation kernel, when every value
    stays finite: 20 bytes a 32-weight group instead of 24, the bytes a decode step streams. Both
    are rounded to 11 significant bits (~0.02%; m's error is shared by the group's 32 weights), far
    below the activations' rounding (8 bits, ~0.4%)."""
    half = scales.half()
    return half if bool(torch.isfinite(half).all()) else scales


def int8_activation_panels(layout: str, codes: torch.Tensor,
                           scales: torch.Tensor) -> Optional[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """A CPU pack in the int4 / int4f or int8g layout as the panels of its integer kernel for int8
    activations: ("int4_q8" | "int8g_q8", codes, scales, N), the scales in fp16 where every value
    stays finite; None for an int8g pack whose codes do not fit 6 bits (Q8_0's: the float kernel)."""
    n = codes.shape[0]
    if layout == "int8g":
        if not gguf_reference.int8g_fits_q8(codes):
            return None
        packed, sm = tandem_kernels.cpu.int8g_q8_pack(codes, scales)
        return "int8g_q8", packed, fp16_scales_if_finite(sm), n
    return ("int4_q8", *tandem_kernels.cpu.int4_q8_pack(codes, fp16_scales_if_finite(scales)), n)


def hold_panels(layer: LinearBase, panels: tuple) -> None:
    """Keep ``int8_activation_panels``' result on the layer (``int4_q8_panels`` / ``int8g_q8_panels``)
    in place of its weight."""
    kind, *held = panels
    setattr(layer, f"{kind}_panels", tuple(held))
    release_weight(layer)


def release_weight(layer: LinearBase) -> None:
    """Free the loaded weight once the method holds its own form (a tied weight stays, for its
    other owner); either way the layer's matmul no longer reads it (``weight_released``)."""
    layer.weight_released = True
    if not getattr(layer, "weight_is_shared", False):
        layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)


def linear_method_for(device: torch.device, dtype: torch.dtype, quantization: Optional[str],
                      int4_activations: str = "exact") -> LinearMethod:
    """The method every linear layer runs; ``int4_activations``: "exact" or "int8" (4-bit CPU layers)."""
    if int4_activations != "exact" and (device.type != "cpu" or quantization not in INT4_QUANTIZATIONS):
        raise ValueError(f"int4_activations={int4_activations!r} applies to 4-bit weights on the CPU")
    int8_activations = int4_activations == "int8"
    if quantization is not None:
        if device.type == "cuda" and quantization in GPU_QUANTIZATIONS:
            pass  # the Triton int4 kernel
        elif device.type != "cpu" or not tandem_kernels.cpu.available():
            raise ValueError(f"quantization={quantization!r} runs on the CPU with the fused kernels only "
                             f"({', '.join(GPU_QUANTIZATIONS)}: on CUDA too)")
        if quantization in ("gguf", "awq", "gptq"):  # packed by gguf_packed.py / int4_checkpoints.py
            method = GgufLinearMethod(linear_method_for(device, dtype, None), int8_activations)
            method.name = quantization
            return method
        if quantization == "int4":
            return Int4LinearMethod(int8_activations)
        return QUANTIZED_METHODS[quantization]()
    if device.type == "cpu" and dtype == torch.bfloat16 and tandem_kernels.cpu.amx_available():
        return AmxLinearMethod()
    if device.type == "cpu" and dtype == torch.bfloat16 and tandem_kernels.cpu.bf16_dot_available():
        return Bf16DotLinearMethod()
    if device.type == "cpu" and torch.backends.mkldnn.is_available() and (
            dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())):
        return OneDnnLinearMethod()
    return LinearMethod()  # e.g. bf16 on a CPU without AVX-512: oneDNN's bf16 reorder refuses it
