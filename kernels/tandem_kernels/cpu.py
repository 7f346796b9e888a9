"""The fused CPU kernels (``csrc/``: one C++ file per op family, with ``amx_linear.cpp`` for
CPUs with AMX): built once per machine, into one library, then loaded.

The first call of ``available()`` compiles each source with the system's C++ compiler against
the installed torch, side by side (as many at once as this process may use cores: ~30 s on 2
idle cores, the longest unit's ~12 s on 5 or more), and links them into one library in
``$TANDEM_KERNEL_CACHE`` (default ``~/.cache/tandem/kernels``; like torch's extension cache it is
per user, not per model cache) under a key of every source and header in ``csrc/``, torch's
version, the compiler and this CPU's flags, so later processes just load it and editing any file
rebuilds. Concurrent builders each write a temporary file and rename it into place. The engine
calls it at start-up, so no request ever waits for a build.

When no compiler is found or the build fails, a warning says why and every op
falls back to ``tandem_kernels.reference`` (same results, slower). ``TANDEM_CPU_KERNELS=0``
turns the fused kernels off on purpose (for comparisons).

The launchers below allocate outputs and return what the reference returns;
the C++ side checks shapes, strides and dtypes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # every .cpp and .h here is part of the build and its key
_COMPILE_FLAGS = ["-O3", "-march=native", "-std=c++17", "-fPIC", "-fopenmp", "-ffp-contract=off", "-w"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
_state: dict = {}  # "ok": bool once decided, "error": why not


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _sources() -> list[Path]:
    """The translation units: each compiled on its own, all linked into one library."""
    return sorted(CSRC.glob("*.cpp"))


def _build_files() -> list[Path]:
    """What the build reads from csrc/: the sources and the headers they include."""
    return sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])


def _compile_command(compiler: str, source: Path, obj: Path) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [compiler, *_COMPILE_FLAGS, abi, *includes, f"-I{sysconfig.get_paths()['include']}",
            "-c", str(source), "-o", str(obj)]


def _link_command(compiler: str, objs: list[Path], output: Path) -> list[str]:
    from torch.utils import cpp_extension

    lib_dir = cpp_extension.library_paths()[0]
    return [compiler, *_LINK_FLAGS, *map(str, objs), "-o", str(output), f"-L{lib_dir}", "-lc10",
            "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]


def library_path(compiler: str) -> Path:
    """Where the build for these sources and headers, torch, compiler and CPU lives: any change to
    a file in csrc/ (or a file added, removed or renamed) gives another path, so a rebuild."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    files = [f"{path.name}\0{path.read_text()}" for path in _build_files()]
    key = hashlib.sha256("\0".join([*files, torch.__version__, version, _cpu_flags(),
                                     " ".join(_COMPILE_FLAGS + _LINK_FLAGS)]).encode()).hexdigest()[:16]
    base = Path(os.environ.get("TANDEM_KERNEL_CACHE") or "~/.cache/tandem/kernels").expanduser()
    return base / f"tandem_cpu_ops-{key}.so"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _run(command: list[str]) -> None:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the compiler failed:\n{proc.stderr[-2000:]}")


def _build(compiler: str) -> tuple[Path, bool]:
    """The library for these sources, and whether this call built it (else it was cached)."""
    output = library_path(compiler)
    if output.exists():
        return output, False
    output.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Building Tandem's CPU kernels with %s (once per machine and version: ~30 s on 2 cores) "
                "into %s ...", Path(compiler).name, output.parent)
    with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
        sources = _sources()
        objs = [Path(tmp) / f"{source.stem}.o" for source in sources]
        # Each translation unit parses torch's headers (~7 s) on its own, so they compile side by side.
        with ThreadPoolExecutor(max_workers=min(len(sources), _usable_cores())) as pool:
            list(pool.map(_run, [_compile_command(compiler, s, o) for s, o in zip(sources, objs)]))
        tmp_out = Path(tmp) / output.name
        _run(_link_command(compiler, objs, tmp_out))
        os.replace(tmp_out, output)
    return output, True


def available() -> bool:
    """True once the fused kernels are loaded (building them on first use)."""
    if "ok" not in _state:
        _state["ok"] = False
        if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
            _state["error"] = "turned off by TANDEM_CPU_KERNELS=0"
        elif (compiler := _compiler()) is None:
            _state["error"] = "no C++ compiler (set CXX or install g++)"
        else:
            start = time.monotonic()
            try:
                library, built = _build(compiler)
                torch.ops.load_library(str(library))
                _state["ok"] = True
                # The backend's start-up phase line (backend/types/startup_log.py), written here
                # because the kernels import nothing of the backend.
                logger.info("[start-up] CPU kernels: %s %s (%.1f s)", "built and loaded" if built else
                            "loaded the cached build", library, time.monotonic() - start)
            except (RuntimeError, OSError) as error:
                _state["error"] = str(error)
        if not _state["ok"]:
            logger.warning("Fused CPU kernels unavailable (%s); using the plain-torch path.",
                           _state["error"])
    return _state["ok"]


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


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """kernels.reference.int8_linear: x [M, K] float32 or bf16 @ (weight [N, K] int8 * scale [N])^T
    + bias -> [M, N] in x's dtype (summed in float32, rounded once)."""
    return torch.ops.tandem_cpu.int8_linear(x, weight, scale, bias)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] float32/bf16 @ reference.int4_dequantize(qweight [N, K / 2] uint8, scales
    [N, K / 32, 2] fp16)^T + bias -> [M, N] in x's dtype; K a multiple of 32."""
    return torch.ops.tandem_cpu.int4_linear(x, qweight, scales, bias)
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


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """kernels.reference.w8a8_linear: x [M, K] float32 or bf16 quantized per row and 32-wide block,
    times (weight [N, K] int8 * scale [N])^T, + bias -> [M, N] in x's dtype. The portable kernel
    (AVX2 or plain C++); with AVX-512 VNNI ``w8a8_linear_packed`` is the fast one."""
    return torch.ops.tandem_cpu.w8a8_linear(x, weight, scale, bias)


def w8a8_vnni_available() -> bool:
    """Whether ``w8a8_linear_packed`` runs here: the kernels are loaded and built for AVX-512 VNNI."""
    return available() and torch.ops.tandem_cpu.w8a8_vnni_available()


def w8a8_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] int8 -> uint8 [ceil(N / 16), ceil(K / 32) * 512], the panels
    ``w8a8_linear_packed`` reads (csrc/w8a8_vnni.cpp)."""
    return torch.ops.tandem_cpu.w8a8_pack_weight(weight)


def w8a8_linear_packed(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``w8a8_linear(x, weight, scale, bias)`` with packed = ``w8a8_pack_weight(weight)``: the
    reference's math on AVX-512 VNNI (one vpdpbusd lane per output column), batch-invariant."""
    return torch.ops.tandem_cpu.w8a8_linear_packed(x, packed, scale, bias)
