"""The fused CPU kernels (``csrc/``: one C++ file per op family, with ``amx_linear.cpp`` for
CPUs with AMX), found or built for this CPU's ISA level, then loaded.

The first call of ``available()`` picks this CPU's level (``tandem_kernels.isa``: avx2, avx512,
avx512_vnni, avx512_bf16 or amx, the highest whose every feature /proc/cpuinfo lists;
``TANDEM_CPU_KERNEL_LEVEL`` may choose a lower one) and loads the library for it
(``tandem_kernels.build`` names and builds them), the first found of:

1. the prebuilt one in ``$TANDEM_PREBUILT_KERNELS`` (default /opt/tandem/kernels; images carry
   every level there, so nothing is compiled at run time);
2. this user's cached build in ``$TANDEM_KERNEL_CACHE`` (default ~/.cache/tandem/kernels);
3. a new build into that cache with the system's C++ compiler ($CXX, else c++ or g++; ~30 s on 2
   idle cores), keyed so that later processes just load it and editing any file in csrc/ rebuilds;
4. where there is no compiler or the build fails: a prebuilt lower level, with a warning.

A CPU that is not x86-64 (Arm, ...) has no levels: its ``native`` build (the compiler's own
-mcpu/-march=native) is cached or built as in 2 and 3, never prebuilt.

The engine starts it in a background thread at its start (``load_in_background``), so a build
overlaps with finding, fetching and converting the model; the first caller that needs the kernels
(the worker, before loading weights) waits for it, and no request ever waits for a build. Callers
in one process are serialized by a lock, processes by ``build.build_lock``. When none of these works
(or the x86-64 CPU is below avx2), a warning says why and every op falls back to
``tandem_kernels.reference`` (same results, slower). ``TANDEM_CPU_KERNELS=0`` turns the fused
kernels off on purpose (for comparisons).

The launchers below allocate outputs and return what the reference returns;
the C++ side checks shapes, strides and dtypes.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from tandem_kernels import build
from tandem_kernels.isa import (LEVELS, NATIVE, IsaLevel, highest_level, host_cpu_flags, host_is_x86_64,
                                level_named, missing_flags)

logger = logging.getLogger(__name__)

_state: dict = {}  # "ok": bool once decided, "error": why not, "library" and "level" once loaded
_deciding = threading.Lock()  # held while ``available()`` finds, builds or loads the library
_background: list[threading.Thread] = []  # the thread ``load_in_background`` started, if any


def host_level() -> Optional[IsaLevel]:
    """The level the kernels are built for here: this x86-64 CPU's highest (None below avx2), or
    the lower one that ``TANDEM_CPU_KERNEL_LEVEL`` names (a level this CPU cannot run is refused:
    ValueError); ``NATIVE`` on any other CPU, where only auto is accepted."""
    flags = host_cpu_flags()
    choice = os.environ.get("TANDEM_CPU_KERNEL_LEVEL", "auto")
    if not host_is_x86_64():
        if choice != "auto":
            raise ValueError(f"TANDEM_CPU_KERNEL_LEVEL={choice}: this CPU is not x86-64 ({platform.machine()}), "
                             "so the kernels are built for it natively; unset it or choose auto")
        return NATIVE
    if choice == "auto":
        return highest_level(flags)
    try:
        level = level_named(choice)
    except ValueError as error:
        raise ValueError(f"TANDEM_CPU_KERNEL_LEVEL: {error} (or auto)") from None
    if missing := missing_flags(level, flags):
        raise ValueError(f"TANDEM_CPU_KERNEL_LEVEL={choice}: this CPU cannot run it (it lacks "
                         f"{', '.join(missing)}); choose a lower level or auto")
    return level


def _below_avx2_reason() -> str:
    flags = host_cpu_flags()
    return (f"this x86-64 CPU is below the lowest ISA level the kernels are built for, avx2 (x86-64-v3): "
            f"it lacks {', '.join(missing_flags(LEVELS[0], flags))}")


def _lower_prebuilt(level: IsaLevel) -> Optional[tuple[Path, IsaLevel]]:
    if level is NATIVE:
        return None
    for lower in reversed(LEVELS[:LEVELS.index(level)]):
        path = build.prebuilt_dir() / build.library_name(lower)
        if path.exists():
            return path, lower
    return None


def _find_or_build(level: IsaLevel) -> tuple[Path, IsaLevel, str]:
    """(library, its level, how it was found). Raises RuntimeError or OSError saying why none."""
    prebuilt = None if level is NATIVE else build.prebuilt_dir() / build.library_name(level)
    if prebuilt is not None and prebuilt.exists():
        return prebuilt, level, "loaded the prebuilt"
    cxx = build.compiler()
    try:
        if cxx is None or shutil.which(cxx) is None:
            where = (f"no prebuilt {level.name} library in {prebuilt.parent}" if prebuilt is not None else
                     f"this {platform.machine()} CPU's kernels are built on it (never prebuilt)")
            raise RuntimeError(f"{where} and no C++ compiler "
                               f"({'CXX=' + cxx + ' is not found' if cxx else 'set CXX or install g++'})")
        cached = build.cached_library(level, cxx)
        if cached.exists():
            return cached, level, "loaded the cached"
        with build.build_lock(cached):
            if cached.exists():  # another process built it while this one waited
                return cached, level, "waited for another process's build, then loaded the"
            target = " ".join(build.target_flags(cxx, level)) or "the compiler's default target"
            logger.info("Building Tandem's CPU kernels for %s (%s) with %s (once per machine and version: ~30 s "
                        "on 2 cores) into %s ...", level.name, target, Path(cxx).name, cached.parent)
            build.build(level, cxx, cached)
        return cached, level, "built and loaded the"
    except (RuntimeError, OSError) as error:
        if (lower := _lower_prebuilt(level)) is None:
            raise
        logger.warning("CPU kernels: %s; using the prebuilt %s library (slower on this CPU).", error,
                       lower[1].name)
        return lower[0], lower[1], "loaded the prebuilt"


def load_in_background() -> None:
    """Start ``available()`` in a daemon thread unless it has been decided or started already, so
    that a build overlaps with whatever the caller does next; a later ``available()`` waits for it."""
    with _deciding:
        if "ok" in _state or any(thread.is_alive() for thread in _background):
            return
        thread = threading.Thread(target=_available_quietly, name="tandem-cpu-kernels", daemon=True)
        _background[:] = [thread]
        thread.start()


def _available_quietly() -> None:
    try:
        available()
    except ValueError:  # a refused TANDEM_CPU_KERNEL_LEVEL: raised again to the next caller
        pass


def available() -> bool:
    """True once the fused kernels are loaded (building them on first use where need be). Safe from
    any thread: one decides, the others wait for its answer."""
    if "ok" in _state:
        return _state["ok"]
    if not _deciding.acquire(blocking=False):
        waiting = threading.current_thread() not in _background
        if waiting:
            logger.info("Waiting for the CPU kernels (being found, built or loaded since the engine started) ...")
        start = time.monotonic()
        _deciding.acquire()
        if waiting:
            logger.info("Waited %.1f s for the CPU kernels.", time.monotonic() - start)
    try:
        return _decide()
    finally:
        _deciding.release()


def _decide() -> bool:
    """Find, build or load the library once; ``_state["ok"]`` is set last, when all is known."""
    if "ok" in _state:
        return _state["ok"]
    off = os.environ.get("TANDEM_CPU_KERNELS", "1") == "0"
    level = None if off else host_level()  # a refused TANDEM_CPU_KERNEL_LEVEL raises, every call
    if off:
        _state["error"] = "turned off by TANDEM_CPU_KERNELS=0"
    elif level is None:
        _state["error"] = _below_avx2_reason()
    else:
        start = time.monotonic()
        try:
            library, level, how = _find_or_build(level)
            torch.ops.load_library(str(library))
            _state.update(library=library, level=level)
            _state["ok"] = True
            # The backend's start-up phase line (backend/types/startup_log.py), written here
            # because the kernels import nothing of the backend.
            where = " in the background" if threading.current_thread() in _background else ""
            logger.info("[start-up] CPU kernels: %s %s build %s%s (%.1f s)", how, level.name, library, where,
                        time.monotonic() - start)
        except (RuntimeError, OSError) as error:
            _state["error"] = str(error)
    if not _state.get("ok"):
        logger.warning("Fused CPU kernels unavailable (%s); using the plain-torch path.", _state["error"])
        _state["ok"] = False
    return _state["ok"]


def loaded_library() -> Optional[tuple[Path, IsaLevel]]:
    """(the loaded library, its ISA level) once ``available()`` loaded one, else None."""
    return (_state["library"], _state["level"]) if available() else None


def unavailable_reason() -> Optional[str]:
    return None if available() else _state.get("error")


# ---- launchers (same contracts as kernels.reference) -------------------------------
# Thin on purpose: at batch 1 a decode step makes ~300 of these calls.

def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""
    return torch.ops.tandem_cpu.paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                                query_start_loc, scale)


def attention_block(qkv, positions, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping, plan,
                    num_heads, num_kv_heads, head_dim, scale) -> torch.Tensor:
    """rotary (cos_sin_cache None: none) + KV write + attention on the fused qkv, in one call."""
    return torch.ops.tandem_cpu.attention_block(
        qkv, positions, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping, plan.block_tables,
        plan.seq_lens, plan.query_start_loc, num_heads, num_kv_heads, head_dim, scale)


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    torch.ops.tandem_cpu.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.tandem_cpu.rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    """In place: returns (rms_norm(x + residual), x + residual) as (x, residual)."""
    torch.ops.tandem_cpu.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def apply_rotary(positions, query, key, cos_sin_cache, head_dim, is_neox=True):
    """Rotates query and key in place and returns them."""
    torch.ops.tandem_cpu.rotary_embedding(positions, query, key, cos_sin_cache, head_dim, is_neox)
    return query, key


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tandem_cpu.silu_and_mul(x)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] float32/bf16 -> [rows] int64: the first maximum of each row (a NaN counts as it)."""
    return torch.ops.tandem_cpu.argmax_rows(x)


def apply_penalties(logits, rows, prompt_seen, output_counts, slots, repetition, frequency, presence) -> None:
    """kernels.reference.apply_penalties in one pass per row (bit-equal)."""
    torch.ops.tandem_cpu.apply_penalties(logits, rows, prompt_seen, output_counts, slots, repetition,
                                         frequency, presence)


def penalized_argmax(logits, rows, prompt_seen, output_counts, slots, repetition, frequency, presence,
                     count: bool) -> torch.Tensor:
    """kernels.reference.penalized_argmax in one pass per row, the logits untouched (same tokens
    and counts)."""
    return torch.ops.tandem_cpu.penalized_argmax(logits, rows, prompt_seen, output_counts, slots, repetition,
                                                 frequency, presence, count)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """kernels.reference.int8_linear: x [M, K] float32 or bf16 @ (weight [N, K] int8 * scale [N])^T
    + bias -> [M, N] in x's dtype (summed in float32, rounded once)."""
    return torch.ops.tandem_cpu.int8_linear(x, weight, scale, bias)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] float32/bf16 @ W^T + bias -> [M, N] in x's dtype; K a multiple of 32. W is
    reference.int4_dequantize(qweight [N, K / 2] uint8, scales [N, K / 32, 2] fp16), or with float32
    scales (int4f) gguf_reference.int4f_dequantize's."""
    return torch.ops.tandem_cpu.int4_linear(x, qweight, scales, bias)


def int4_q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gguf_reference.int4_q8_linear: 4-bit weights (``gguf_reference.pack_int4_q8``'s panels of an
    [N, K] weight) against x [M, K] float32/bf16 quantized to 8 bits per 32 values, integer dot
    products (csrc/int4_q8.cpp) -> [M, N] in x's dtype."""
    return torch.ops.tandem_cpu.int4_q8_linear(x, codes, scales, n, bias)


def int4_q8_pack(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf_reference.pack_int4_q8, in one parallel pass (csrc/int4_q8.cpp)."""
    return torch.ops.tandem_cpu.int4_q8_pack(qweight, scales)


def int8g_q8_pack(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf_reference.pack_int8g_q8, in one parallel pass (csrc/int8g_q8.cpp); refuses codes outside
    [-32, 31]."""
    return torch.ops.tandem_cpu.int8g_q8_pack(codes, scales)


def int8g_q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gguf_reference.int8g_q8_linear: int8g weights with 6-bit codes (``gguf_reference.pack_int8g_q8``'s
    panels of an [N, K] weight) against x [M, K] float32/bf16 quantized to 8 bits per 32 values,
    integer dot products (csrc/int8g_q8.cpp) -> [M, N] in x's dtype."""
    return torch.ops.tandem_cpu.int8g_q8_linear(x, codes, scales, n, bias)


def int8_bf16_available() -> bool:
    """Whether ``int8_linear_packed`` runs here: the kernels are loaded and built for AVX-512 BF16."""
    return available() and torch.ops.tandem_cpu.int8_bf16_available()


def int8_pack_weight_bf16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] int8 -> int8 [ceil(N / 16), ceil(K / 2) * 32], the panels ``int8_linear_packed``
    reads (csrc/int8_bf16.cpp)."""
    return torch.ops.tandem_cpu.int8_pack_weight_bf16(weight)


def int8_linear_packed(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``int8_linear(x, weight, scale, bias)`` for x [M, K] bf16 with packed =
    ``int8_pack_weight_bf16(weight)``: bf16 dot products (exact products, float sums, one lane per
    output column), batch-invariant -> [M, N] bf16."""
    return torch.ops.tandem_cpu.int8_linear_packed(x, packed, scale, bias)


def amx_available() -> bool:
    """Whether ``amx_linear`` runs here: the kernels are loaded, built for a CPU with AMX, and
    Linux granted this process the tile registers."""
    return available() and torch.ops.tandem_cpu.amx_available()


def amx_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> the tile layout ``amx_linear`` reads (csrc/amx_linear.cpp)."""
    return torch.ops.tandem_cpu.amx_pack_weight(weight)


def amx_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] bf16 @ weight^T + bias -> [M, N] bf16, the weight packed by ``amx_pack_weight``:
    products exact, summed in fp32 (F.linear's math in another order), rounded once."""
    return torch.ops.tandem_cpu.amx_linear(x, packed, n, bias)


def amx_gated_order(d: int) -> torch.Tensor:
    """The row order ``amx_gated_linear`` wants of a [gate | up] weight of 2d rows (d % 32 == 0),
    to pack: its 32-row panels alternating, gate rows [0, 32), up rows [0, 32), gate [32, 64), ..."""
    return torch.arange(2 * d).view(2, d // 32, 32).transpose(0, 1).reshape(-1)


def amx_gated_linear(x: torch.Tensor, packed: torch.Tensor, d: int) -> torch.Tensor:
    """x [M, K] bf16 -> [M, d] bf16: SiLU(gate) * up, bit for bit silu_and_mul(amx_linear(x, gate
    | up)), packed = amx_pack_weight(weight[amx_gated_order(d)]) of the [2d, K] gate | up weight."""
    return torch.ops.tandem_cpu.amx_gated_linear(x, packed, d)


def bf16_dot_available() -> bool:
    """Whether ``bf16_dot_linear`` runs here: the kernels are loaded and built for AVX-512 BF16."""
    return available() and torch.ops.tandem_cpu.bf16_dot_available()


def bf16_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> bf16 [ceil(N / 16), ceil(K / 2) * 32], the panels ``bf16_dot_linear``
    reads (csrc/bf16_linear.cpp)."""
    return torch.ops.tandem_cpu.bf16_pack_weight(weight)


def bf16_dot_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] bf16 @ weight^T + bias -> [M, N] bf16, the weight packed by ``bf16_pack_weight``:
    products exact, summed in fp32 over K in order (F.linear's math in another order), rounded
    once; batch-invariant."""
    return torch.ops.tandem_cpu.bf16_dot_linear(x, packed, n, bias)


def bf16_dot_gated_linear(x: torch.Tensor, packed: torch.Tensor, d: int) -> torch.Tensor:
    """x [M, K] bf16 -> [M, d] bf16: SiLU(gate) * up, bit for bit silu_and_mul(bf16_dot_linear(x,
    gate | up)), packed = bf16_pack_weight(weight[amx_gated_order(d)]) of the [2d, K] gate | up
    weight (d % 32 == 0)."""
    return torch.ops.tandem_cpu.bf16_dot_gated_linear(x, packed, d)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """kernels.reference.w8a8_linear: x [M, K] float32 or bf16 quantized per row and 32-wide block,
    times (weight [N, K] int8 * scale [N])^T, + bias -> [M, N] in x's dtype, on the plain weight
    (AVX2 or plain C++); ``w8a8_linear_packed`` is the fast one."""
    return torch.ops.tandem_cpu.w8a8_linear(x, weight, scale, bias)


def w8a8_vnni_available() -> bool:
    """Whether ``w8a8_linear_packed`` runs its AVX-512 VNNI kernel here (else its AVX2 or plain one)."""
    return available() and torch.ops.tandem_cpu.w8a8_vnni_available()


def w8a8_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] int8 -> uint8 [ceil(N / 16), ceil(K / 32) * 512], the panels
    ``w8a8_linear_packed`` reads (csrc/w8a8_packed.cpp)."""
    return torch.ops.tandem_cpu.w8a8_pack_weight(weight)


def w8a8_linear_packed(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``w8a8_linear(x, weight, scale, bias)`` with packed = ``w8a8_pack_weight(weight)``: the
    reference's math, one vector lane per output column (vpdpbusd on AVX-512 VNNI, vpmaddubsw on
    AVX2, plain loops elsewhere; all give the same bits), batch-invariant."""
    return torch.ops.tandem_cpu.w8a8_linear_packed(x, packed, scale, bias)


def gguf_int8g_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gguf_reference.int8g_linear: x [M, K] float32/bf16 @ int8g_dequantize(codes [N, K] int8,
    scales [N, K / 16, 2] float32)^T + bias -> [M, N] in x's dtype (csrc/gguf_linear.cpp)."""
    return torch.ops.tandem_cpu.gguf_int8g_linear(x, codes, scales, bias)


ISA_PEAK_KINDS = ("int8", "bf16", "fp32")


def isa_peak(kind: str, seconds: float = 0.2) -> float:
    """G multiply-adds a second that the build's ``kind`` dot-product instruction ("int8": vpdpbusd,
    or AVX2's vpmaddubsw chain; "bf16": vdpbf16ps; "fp32": vfmadd) retires on every torch thread at
    once, with no memory traffic: the compute ceiling of the matmul kernels (csrc/isa_peak.cpp). A
    kind this build lacks raises, naming it."""
    return torch.ops.tandem_cpu.isa_peak(kind, seconds)
