"""Writing AWQ (GEMM) and GPTQ 4-bit safetensors checkpoints from a plain Hugging Face one, with
packers written from the formats' documented layouts (loops over nibble positions, independent of
backend/models/int4_checkpoints.py's vectorized unpacking):

    AWQ   qweight [K, N / 8] int32: nibble i of word c holds column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]
          qzeros  [K / gs, N / 8] int32, packed the same way; scales [K / gs, N] fp16; w = (q - z) s
    GPTQ  qweight [K / 8, N] int32: nibble j of row i holds input 8i + j
          qzeros  [K / gs, N / 8] int32: nibble j of word c holds z - 1 of output 8c + j
          scales  [K / gs, N] fp16; g_idx [K] int32 = k // gs; w = (q - z) s
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_awq(codes_kn: np.ndarray) -> np.ndarray:
    """[R, N] values 0..15 -> [R, N / 8] int32 in AWQ's interleaved column order."""
    rows, n = codes_kn.shape
    out = np.zeros((rows, n // 8), dtype=np.uint32)
    for word in range(n // 8):
        for nibble, column in enumerate(AWQ_PACK_ORDER):
            out[:, word] |= codes_kn[:, 8 * word + column].astype(np.uint32) << np.uint32(4 * nibble)
    return out.view(np.int32)


def pack_gptq_rows(codes_kn: np.ndarray) -> np.ndarray:
    """[K, N] values 0..15 -> [K / 8, N] int32: input 8i + j in nibble j of row i."""
    k, n = codes_kn.shape
    out = np.zeros((k // 8, n), dtype=np.uint32)
    for row in range(k // 8):
        for nibble in range(8):
            out[row] |= codes_kn[8 * row + nibble].astype(np.uint32) << np.uint32(4 * nibble)
    return out.view(np.int32)


def pack_gptq_zeros(zeros_gn: np.ndarray) -> np.ndarray:
    """[G, N] zeros 1..16 -> [G, N / 8] int32 holding z - 1, output 8c + j in nibble j of word c."""
    g, n = zeros_gn.shape
    out = np.zeros((g, n // 8), dtype=np.uint32)
    for word in range(n // 8):
        for nibble in range(8):
            out[:, word] |= (zeros_gn[:, 8 * word + nibble] - 1).astype(np.uint32) << np.uint32(4 * nibble)
    return out.view(np.int32)


def quantize(weight: torch.Tensor, group: int, sym: bool, zero_range: tuple[int, int]):
    """weight [N, K] -> codes [K, N] uint8, zeros [G, N] int, scales [G, N] fp16: round to nearest per
    row and group (sym: z = 8), zeros clamped to ``zero_range``."""
    n, k = weight.shape
    gs = k if group == -1 else group
    w = weight.float().view(n, k // gs, gs)
    if sym:
        s = (w.abs().amax(dim=2) / 7.5).clamp_min(1e-6).half()
        z = torch.full_like(s, 8, dtype=torch.int64)
    else:
        low, high = w.amin(dim=2), w.amax(dim=2)
        s = ((high - low) / 15).clamp_min(1e-6).half()
        z = torch.round(-low / s.float()).long().clamp(*zero_range)
    q = torch.round(w / s.float().unsqueeze(2)) + z.unsqueeze(2)
    q = q.clamp(0, 15).to(torch.uint8).view(n, k)
    return q.t().numpy(), z.t().numpy(), s.t().contiguous()


def dequantize(codes_kn: np.ndarray, zeros_gn: np.ndarray, scales_gn: torch.Tensor) -> torch.Tensor:
    """The format's weight [N, K] fp32: (q - z) s, exact in fp32."""
    k = codes_kn.shape[0]
    gs = k // zeros_gn.shape[0]
    z = torch.from_numpy(zeros_gn).float().repeat_interleave(gs, dim=0)  # [K, N]
    s = scales_gn.float().repeat_interleave(gs, dim=0)
    return ((torch.from_numpy(codes_kn).float() - z) * s).t().contiguous()


def write_int4_checkpoint(source: Path, out: Path, method: str, group: int, sym: bool = False,
                          skip: tuple[str, ...] = (), config_extra: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """``source``'s linears (except names containing a ``skip`` fragment) quantized as ``method`` into
    ``out`` (safetensors, plain tensors fp16, config.json with quantization_config, the tokenizer);
    returns the checkpoint's model as a plain fp32 state dict (the dequantized weights)."""
    out.mkdir(parents=True, exist_ok=True)
    plain = load_file(str(source / "model.safetensors"))
    tensors, model = {}, {}
    for name, tensor in plain.items():
        prefix = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS) or any(f in name for f in skip):
            tensors[name] = tensor.half()
            model[name] = tensor.half().float()
            continue
        zero_range = (0, 15) if method == "awq" else (1, 16)
        codes, zeros, scales = quantize(tensor, group, sym, zero_range)
        if method == "awq":
            tensors |= {f"{prefix}.qweight": pack_awq(codes), f"{prefix}.qzeros": pack_awq(zeros.astype(np.uint8))}
        else:
            k = codes.shape[0]
            g_idx = np.arange(k, dtype=np.int32) // (k if group == -1 else group)
            tensors |= {f"{prefix}.qweight": pack_gptq_rows(codes), f"{prefix}.qzeros": pack_gptq_zeros(zeros),
                        f"{prefix}.g_idx": g_idx}
        tensors[f"{prefix}.scales"] = scales
        model[name] = dequantize(codes, zeros, scales)
    tensors = {key: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
               for key, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    qc = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
          if method == "awq" else
          {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": sym,
           "checkpoint_format": "gptq"})
    config["quantization_config"] = qc | (config_extra or {})
    (out / "config.json").write_text(json.dumps(config))
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(file, out / file.name)
    return model
