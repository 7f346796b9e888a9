"""Compile the CUDA path's Triton launches for real GPU targets on a machine without a GPU.

Triton's compiler needs no GPU: with its bundled ptxas it turns a kernel into a cubin for
any target. This module proves every launch the CUDA path makes compiles, and reads what
each specialization costs (registers, spill space, shared memory):

1. ``record_launches(shape, dtype)`` runs the real launchers (the functions ``ops`` calls on
   CUDA) on small CPU tensors with every ``@triton.jit`` kernel swapped for a recorder, so
   the arguments, constexprs, ``num_warps`` and ``num_stages`` recorded are exactly what
   the launcher passes (its choices come from ``launch_config``).
2. ``compile_launch(launch, target)`` specializes the arguments as Triton's JIT does at a
   launch (its own binder: dtypes, 16-byte divisibility) and compiles for that target.
3. The cubin's resource usage comes from the bundled ``cuobjdump -res-usage``. A Triton
   kernel has no local arrays, so a nonzero stack frame is register spill space.

Needs the compiler: with TRITON_INTERPRET=1 (the CPU tests) ``@triton.jit`` builds
interpreted functions, so use it in a process without that variable, e.g. the table's script
(what tests/test_kernel_compile.py runs)::

    python bench/kernel_compile_table.py --targets 90 --dtypes bf16
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from tandem_kernels import activations, attention, cache_ops, int4_matmul, norms, rotary
from tandem_kernels.reference import VarlenPlan, kv_cache_shape

LAUNCHER_MODULES = (attention, cache_ops, norms, rotary, activations, int4_matmul)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Largest dynamic shared memory one block may use (the opt-in maximum: A100, H100/H200, B200).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}
BLOCK_SIZE = 16  # KV-cache tokens per block, the engine's default


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that reach the kernels."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    rotary_dim: int
    is_neox: bool = True


# Real checkpoints' configs (config.json). The head-dim 80/96/256 ones are the sizes of Phi-2,
# Phi-3-mini and Gemma-2B (families Tandem does not serve yet; their kernels' shapes are the point).
SHAPES = [
    ModelShape("SmolLM2-135M", 9, 3, 64, 576, 1536, 64),
    ModelShape("Qwen2.5-0.5B", 14, 2, 64, 896, 4864, 64),
    ModelShape("Llama-3.2-1B", 32, 8, 64, 2048, 8192, 64),
    ModelShape("Llama-3.1-8B", 32, 8, 128, 4096, 14336, 128),
    ModelShape("Phi-2 (d=80)", 32, 32, 80, 2560, 10240, 32),
    ModelShape("Phi-3-mini (d=96)", 32, 32, 96, 3072, 8192, 96),
    ModelShape("Gemma-2B (d=256)", 8, 1, 256, 2048, 16384, 256),
]

# The int4 dequant-GEMM at a few real shapes only (its specializations depend on the row count and
# the weight's width, not the head shape): these models' layers, decode / batch / prompt rows, int4
# (fp16 scales) and int4f (fp32); bf16 and fp16 x only (the GPU kernel takes no fp32 x).
INT4_MODELS = ("Llama-3.2-1B", "Llama-3.1-8B")
INT4_ROWS = (1, 64, 512)

# (label, per request (tokens cached before, tokens this step), KV splits or None for the kernel's choice)
ATTENTION_CASES = [
    ("decode split-KV", [(4095, 1)], 4),
    ("decode 64 splits", [(16383, 1)], 64),  # the most splits kv_splits picks: the widest merge
    ("decode", [(1023, 1)] * 32, 1),
    ("prefill+decode", [(0, 512), (300, 200), (4000, 1)], None),
]


@dataclass
class Launch:
    """One recorded kernel launch: what ``kernel[grid](*args, **kwargs)`` was given."""

    case: str
    kernel: Any  # the JITFunction
    grid: tuple
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.__name__


@dataclass
class KernelReport:
    case: str
    kernel: str
    target: int
    constexprs: dict
    num_warps: int
    num_stages: int
    registers: int
    spill_bytes: int  # the stack frame: register spill space in a Triton kernel
    shared_bytes: int  # dynamic shared memory the launch requests
    shared_limit: int
    mma: list  # the tensor-core instructions in its PTX (input types in the name), [] if none


class _Recorder:
    def __init__(self, kernel, case: str, sink: list[Launch]):
        self.kernel, self.case, self.sink = kernel, case, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append(Launch(self.case, self.kernel, tuple(grid), args, kwargs))
        return launch


def jit_kernels() -> dict[str, Any]:
    """Every @triton.jit function of the launcher modules, by name (refuses interpreted ones)."""
    from triton.runtime.jit import JITFunction

    found = {}
    for module in LAUNCHER_MODULES:
        for name, value in vars(module).items():
            if type(value).__name__ == "InterpretedFunction":
                raise RuntimeError("compile_probe needs Triton's compiler: unset TRITON_INTERPRET")
            if isinstance(value, JITFunction):
                found[name] = value
    return found


def entry_kernels() -> set[str]:
    """The jit functions launched from the host: those no other jit function calls (read from
    the sources, so it also answers under the interpreter)."""
    sources = {}
    for module in LAUNCHER_MODULES:
        for name, value in vars(module).items():
            if type(value).__name__ in ("JITFunction", "InterpretedFunction"):
                sources[name] = inspect.getsource(getattr(value, "fn", value))
    called = {name for name in sources for other, src in sources.items()
              if other != name and re.search(rf"\b{name}\(", src)}
    return set(sources) - called


@contextlib.contextmanager
def _recording(case: str, sink: list[Launch]) -> Iterator[None]:
    """Every jit function of the launcher modules swapped for a recorder (restored after,
    before anything compiles: kernels that call helpers resolve them in the module)."""
    kernels = jit_kernels()
    originals = []
    for module in LAUNCHER_MODULES:
        for name, value in list(vars(module).items()):
            if kernels.get(name) is value:
                originals.append((module, name, value))
                setattr(module, name, _Recorder(value, case, sink))
    try:
        yield
    finally:
        for module, name, value in originals:
            setattr(module, name, value)


def _attention_inputs(shape: ModelShape, dtype: torch.dtype, requests, splits):
    """Tensors with the runtime's shapes and strides (q a view of a fused QKV output); the
    kernels are recorded, not run, so the cache holds a few blocks and the tables point at them."""
    num_tokens = sum(n for _, n in requests)
    width = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    qkv = torch.zeros(num_tokens, width, dtype=dtype)
    query = qkv[:, :shape.heads * shape.head_dim].view(num_tokens, shape.heads, shape.head_dim)
    k_cache = torch.zeros(kv_cache_shape(4, BLOCK_SIZE, shape.kv_heads, shape.head_dim), dtype=dtype)
    max_blocks = 8192 // BLOCK_SIZE  # a max_model_len of 8192
    starts = [0]
    for _, n in requests:
        starts.append(starts[-1] + n)
    plan = VarlenPlan(block_tables=torch.zeros(len(requests), max_blocks, dtype=torch.int32),
                      seq_lens=torch.tensor([c + n for c, n in requests], dtype=torch.int32),
                      query_start_loc=torch.tensor(starts, dtype=torch.int32),
                      max_query_len=max(n for _, n in requests),
                      max_seq_len=max(c + n for c, n in requests), num_splits=splits)
    return query, k_cache, plan


def record_launches(shape: ModelShape, dtype: torch.dtype) -> list[Launch]:
    """Every kernel launch one forward step of this model makes, per attention case."""
    sink: list[Launch] = []
    d = shape.head_dim
    for label, requests, splits in ATTENTION_CASES:
        query, k_cache, plan = _attention_inputs(shape, dtype, requests, splits)
        with _recording(label, sink):
            attention.paged_attention(query, None, None, k_cache, k_cache.clone(), plan, d ** -0.5)

    tokens = 8
    qkv = torch.zeros(tokens, (shape.heads + 2 * shape.kv_heads) * d, dtype=dtype)
    q, k, v = qkv.split([shape.heads * d, shape.kv_heads * d, shape.kv_heads * d], dim=-1)
    positions = torch.arange(tokens, dtype=torch.int64)
    cos_sin = torch.zeros(8192, shape.rotary_dim, dtype=torch.float32)
    k_cache = torch.zeros(kv_cache_shape(4, BLOCK_SIZE, shape.kv_heads, d), dtype=dtype)
    x = torch.zeros(tokens, shape.hidden, dtype=dtype)
    weight = torch.zeros(shape.hidden, dtype=dtype)
    with _recording("layer", sink):
        rotary.apply_rotary(positions, q, k, cos_sin, d, shape.is_neox)
        cache_ops.write_kv_cache(k.view(tokens, shape.kv_heads, d), v.view(tokens, shape.kv_heads, d),
                                 k_cache, k_cache.clone(), positions)
        norms.rms_norm(x, weight, 1e-6)
        norms.fused_add_rms_norm(x, x.clone(), weight, 1e-6)
        activations.silu_and_mul(torch.zeros(tokens, 2 * shape.intermediate, dtype=dtype))
    if shape.name in INT4_MODELS and dtype != torch.float32:
        _record_int4(shape, dtype, sink)
    return sink


def _record_int4(shape: ModelShape, dtype: torch.dtype, sink: list[Launch]) -> None:
    """The int4 linears of one layer (qkv, o, gate_up, down) at INT4_ROWS rows, int4 and int4f."""
    d = shape.head_dim
    layers = [((shape.heads + 2 * shape.kv_heads) * d, shape.hidden), (shape.hidden, shape.heads * d),
              (2 * shape.intermediate, shape.hidden), (shape.hidden, shape.intermediate)]  # (N, K)
    for rows in INT4_ROWS:
        for layout, scale_dtype in (("int4", torch.float16), ("int4f", torch.float32)):
            with _recording(f"{layout} linear, {rows} rows", sink):
                for n, k in layers:
                    int4_matmul.int4_linear(torch.zeros(rows, k, dtype=dtype), torch.zeros(n, k // 2, dtype=torch.uint8),
                                            torch.zeros(n, k // 32, 2, dtype=scale_dtype), None)


def _jit_kwargs(kernel, kwargs: dict) -> dict:
    """The options JITFunction.run adds before specializing (Triton 3.9)."""
    from triton import knobs

    out = dict(kwargs)
    out.setdefault("debug", kernel.debug or knobs.runtime.debug)
    if hasattr(knobs.compilation, "instrumentation_mode"):
        out["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
        out["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    return out


def compile_launch(launch: Launch, capability: int):
    """The compiled kernel Triton would build for this launch on a GPU of this capability."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    kwargs = _jit_kwargs(kernel, launch.kwargs)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


_MMA = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync|tcgen05\.mma)[\w.:]*")
_RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """registers, stack (spill) bytes, static shared and local bytes of a one-kernel cubin."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", path], capture_output=True,
                             text=True, check=True).stdout
    match = _RES_USAGE.search(out)
    if match is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line:\n{out}")
    regs, stack, shared, local = map(int, match.groups())
    return {"registers": regs, "stack": stack, "static_shared": shared, "local": local}


def _constexprs(launch: Launch) -> dict:
    names = {p.name for p in launch.kernel.params if p.is_constexpr}
    return {k: v for k, v in launch.kwargs.items() if k in names}


def report(launch: Launch, capability: int) -> KernelReport:
    compiled = compile_launch(launch, capability)
    usage = resource_usage(compiled.asm["cubin"])
    return KernelReport(case=launch.case, kernel=launch.name, target=capability,
                        constexprs=_constexprs(launch), num_warps=compiled.metadata.num_warps,
                        num_stages=compiled.metadata.num_stages, registers=usage["registers"],
                        spill_bytes=usage["stack"] + usage["local"], shared_bytes=compiled.metadata.shared,
                        shared_limit=SHARED_LIMIT[capability],
                        mma=sorted(set(_MMA.findall(compiled.asm["ptx"]))))


def supported_targets() -> list[int]:
    """80 and 90 always; 100 where the installed Triton compiles for Blackwell (3.3 and later)."""
    import triton

    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return [80, 90, 100] if (major, minor) >= (3, 3) else [80, 90]


def _specialization_key(launch: Launch) -> tuple:
    """Launches that compile to the same kernel: same kernel, argument dtypes/divisibility, constexprs."""
    from triton.compiler import make_backend
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    _, specialization, _ = binder(*launch.args, **_jit_kwargs(kernel, launch.kwargs))
    return kernel.__name__, repr(specialization), repr(sorted(launch.kwargs.items()))


def distinct_launches(shapes: list[ModelShape], dtype_names: list[str]) -> list[dict]:
    """The distinct kernel specializations these models launch, each with every (model, dtype,
    case) that launches it."""
    seen: dict[tuple, dict] = {}
    for shape in shapes:
        for dtype_name in dtype_names:
            for launch in record_launches(shape, DTYPES[dtype_name]):
                where = f"{shape.name} {dtype_name} {launch.case}"
                entry = seen.setdefault(_specialization_key(launch), {
                    "launch": launch, "used_by": [], "model": shape.name, "dtype": dtype_name,
                    "head_dim": shape.head_dim})
                entry["used_by"].append(where)
    return list(seen.values())


_POOL_WORK: list[dict] = []  # what forked compile workers read (inherited, never pickled)


def _row(task: tuple[int, int]) -> dict:
    index, capability = task
    entry = _POOL_WORK[index]
    row = {"kernel": entry["launch"].name, "case": entry["launch"].case, "target": capability}
    try:
        row.update(dataclasses.asdict(report(entry["launch"], capability)))
    except Exception as e:  # a compile error is a result: the caller reports every one
        row.update(error=f"{type(e).__name__}: {str(e)[-2000:]}")
    row.update(model=entry["model"], dtype=entry["dtype"], head_dim=entry["head_dim"], used_by=entry["used_by"])
    return row


def probe(shapes: list[ModelShape], dtype_names: list[str], targets: list[int], jobs: int = 1) -> Iterator[dict]:
    """One row per distinct (kernel specialization, target): a KernelReport's fields (or
    ``error``), the model/dtype/case that first launched it and ``used_by``, all of them.
    jobs > 1 compiles in that many forked processes (the compiler is single-threaded)."""
    global _POOL_WORK
    _POOL_WORK = distinct_launches(shapes, dtype_names)
    tasks = [(i, capability) for i in range(len(_POOL_WORK)) for capability in targets]
    if jobs <= 1:
        yield from map(_row, tasks)
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        yield from pool.imap(_row, tasks)
