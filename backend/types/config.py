"""EngineConfig: every engine setting, validated once, shared by offline and online modes.

Pure Python: the frontend reads it for the command line and ``LLM(...)``. What depends on the
checkpoint and the device (its path, HF config, dtype, max_model_len) is filled in by
``backend.models.resolve.resolve_config``.

The same names mean the same thing as vLLM's engine arguments, for ``LLM(...)``
and for the ``tandem`` command line alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from backend.types.errors import InvalidRequestError

DTYPES = ("auto", "float32", "bfloat16", "float16")
EXECUTORS = ("uni", "mp", "ray", "external_launcher")
QUANTIZATIONS = ("int8", "w8a8", "int4", "gguf", "awq", "gptq")  # int8 / int4 weights on the CPU (backend/models/linear_methods.py)
# The KV cache's element type: auto = the model's dtype; fp8 = fp8_e4m3 (float8_e4m3fn, as vLLM's).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
INT4_QUANTIZATIONS = ("int4", "gguf", "awq", "gptq")  # 4-bit weights (gguf: its Q4 layers)
INT4_ACTIVATIONS = ("exact", "int8")  # the 4-bit CPU matmuls' activations (backend/models/linear_methods.py)
MAX_GRAMMAR_COMPILE_WORKERS = 64  # each a process holding xgrammar (and torch)
MAX_STREAM_INTERVAL = 1024  # stream_interval: tokens per streamed delta
MAX_JSON_WHITESPACE = 4096  # json_max_whitespace: a bound, not a repetition count to blow up the grammar


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 natively (x86 avx512_bf16/AMX, Arm bf16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set()
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


# Each setting's meaning: the one source of the ``--flag`` help texts (which add the default).
FIELD_HELP = {
    "tokenizer": "tokenizer directory (default: the model's)",
    "served_model_name": "the model name clients use (default: the model argument)",
    "revision": "hub revision of the model",
    "dtype": "auto = bf16 on GPUs and on CPUs with native bf16 (avx512_bf16/AMX), else fp32; "
             f"or one of {', '.join(DTYPES[1:])}",
    "seed": "global RNG seed (a request's seed overrides it)",
    "device": "auto, cpu or cuda",
    "max_model_len": "longest prompt + output in tokens (default: the model's)",
    "max_num_seqs": "sequences in one batch",
    "max_num_batched_tokens": "tokens in one step (prompt chunks + decodes)",
    "enable_chunked_prefill": "split long prompts over several steps",
    "block_size": "tokens per KV-cache block",
    "enable_prefix_caching": "reuse the KV blocks of shared prefixes",
    "enforce_eager": "no decode graphs (CUDA graphs; traced graphs on the CPU)",
    "kv_cache_memory_gb": "KV-cache size on CPU, GiB",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and the KV cache",
    "num_kv_blocks": "exact number of KV-cache blocks (overrides the two above)",
    "tensor_parallel_size": "GPUs (or CPU workers) one layer is split over",
    "pipeline_parallel_size": "stages the layers are split into",
    "distributed_executor_backend": f"one of {', '.join(EXECUTORS)} (default: uni for one worker; "
                                    "ray once this process joined Ray or the GPUs are not all on "
                                    "this machine; else mp)",
    "download_dir": "where fetched and converted models live (default: $TANDEM_CACHE or ~/.cache/tandem)",
    "quantization": "weights quantized on the CPU, activations and KV cache in --dtype (float32 or bfloat16; "
                    "auto as without quantization): int8 (weight-only: the matmul with the dequantized "
                    "weights; in bf16 with AVX-512 BF16 about as fast as bf16 at large batches, in float32 "
                    "far slower), w8a8 (activations also quantized per 32-wide block, approximate; with "
                    "AVX-512 VNNI faster than bf16 at every batch size), int4 (weight-only, 4 bits per "
                    "32-wide group with an fp16 scale and min, quantized at load) or gguf (model= a Llama "
                    ".gguf file: its Q4_0/Q4_1 weights served packed by the int4 kernel, the rest "
                    "dequantized), awq or gptq (a checkpoint's 4-bit AWQ/GPTQ weights served packed; "
                    "set from its config.json); on CUDA int4, gguf, awq and gptq also run, with bfloat16 or "
                    "float16 activations (a Triton kernel) (default: the checkpoint's precision)",
    "int4_activations": "the activations of the 4-bit CPU matmuls (int4, gguf, awq, gptq): exact (default: "
                        "--dtype's, the model with its weights dequantized) or int8 (quantized to 8 bits per "
                        "32 values before each 4-bit matmul, integer dot products, much as llama.cpp runs its "
                        "4-bit GGUF types: faster on AVX2 CPUs, approximate; tokens may differ from the "
                        "dequantized model's; in a GGUF file its Q5_K / Q6_K layers too, not its Q8_0 ones)",
    "kv_cache_dtype": "auto = the model's dtype; fp8 (= fp8_e4m3): K and V stored as float8 e4m3, "
                      "clamped to +-448 with no scaling factor, half of bf16's bytes (twice the blocks "
                      "in the same memory, half the bytes attention reads); approximate; CPU only",
    "speculative_config": 'speculative decoding by n-gram prompt lookup, vLLM\'s JSON, e.g. '
                          '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                          '"prompt_lookup_min": 1, "disable_by_batch_size": 8}\' (default: off)',
    "grammar_compile_timeout_s": "seconds a structured-output grammar may take to compile (in a worker "
                                 "process, killed past it); then the request gets a 400",
    "async_scheduling": "schedule and prepare each step while the one before runs on the device, "
                        "hiding the host's work (one worker only; not with speculative decoding). "
                        "(default: on with CUDA; off on the CPU, where the model and the engine's "
                        "host work share the same cores)",
    "json_max_whitespace": "most whitespace characters a JSON grammar (json, json_object, response_format, "
                           "tool calls) allows between two JSON tokens, so a model cannot loop on newlines "
                           "until max_tokens; 20 fits a newline and indentation 19 deep, as llama.cpp's JSON "
                           "grammar allows; 0: unbounded. structured_outputs.disable_any_whitespace still "
                           "allows none",
    "stream_interval": "tokens per streamed delta of a served request: a sequence's first token goes out at "
                       "once, then its tokens in groups of this many, and its end with whatever is left; "
                       "larger values cost the backend, the frontend and the client less per token at the "
                       "price of burstier streams (offline LLM.generate returns whole outputs and is "
                       "unaffected)",
    "grammar_compile_workers": "worker processes compiling structured-output grammars at once "
                               "(each ~300 MB; two or more, so one slow grammar never holds up another)",
}


def add_dataclass_cli_args(parser: argparse.ArgumentParser, cls: type, names: list[str],
                           help_texts: Optional[dict[str, str]] = None) -> None:
    """One ``--flag-name`` per named field of dataclass ``cls``, typed from its annotation.

    ``Optional[X]`` parses X (None is simply the default); bools get ``--x/--no-x``. Each help
    text is ``help_texts[name]`` (else the name in words) plus the default, unless it names one.
    """
    defaults = cls()
    hints = typing.get_type_hints(cls)
    for name in names:
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        kind = next((t for t in typing.get_args(hints[name]) if t is not type(None)), hints[name])
        help_text = (help_texts or {}).get(name, name.replace("_", " "))
        if "(default:" not in help_text:
            shown = ("on" if default else "off") if kind is bool else default
            help_text += f" (default: {shown})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif kind is dict:
            parser.add_argument(flag, type=json.loads, default=default, metavar="JSON", help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=help_text)


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` for n-gram prompt lookup (the one method implemented).

    ``disable_by_batch_size``: no drafts while more requests than this are running (verifying
    drafts costs extra rows in every matmul, which pays only while the step is bandwidth-bound).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: Optional[int] = None

    MAX_SPECULATIVE_TOKENS = 16

    @classmethod
    def from_dict(cls, value: Any) -> "SpeculativeConfig":
        """Validate a user's dict (or JSON string); errors name the key."""
        def bad(message: str) -> None:
            raise InvalidRequestError(f"speculative_config: {message}", param="speculative_config")

        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                bad(f"not valid JSON: {value!r}.")
        if not isinstance(value, dict):
            bad(f"expected a JSON object, got {type(value).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            bad(f"unsupported key(s) {', '.join(unknown)}; supported: {', '.join(sorted(known))}.")
        if value.get("method", "ngram") != "ngram":
            bad(f"method {value['method']!r} is not supported; only 'ngram' (prompt lookup) is.")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "disable_by_batch_size"):
            if key in value and value[key] is not None and (
                    not isinstance(value[key], int) or isinstance(value[key], bool) or value[key] < 1):
                bad(f"{key} must be a positive integer, got {value[key]!r}.")
        config = cls(**value)
        if config.num_speculative_tokens > cls.MAX_SPECULATIVE_TOKENS:
            bad(f"num_speculative_tokens must be at most {cls.MAX_SPECULATIVE_TOKENS}, "
                f"got {config.num_speculative_tokens}.")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            bad(f"prompt_lookup_min ({config.prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({config.prompt_lookup_max}).")
        return config


@dataclass
class EngineConfig:
    """All engine settings. ``model=None`` means the default model.

    Construction validates the plain values; ``resolve()`` then finds the
    checkpoint, reads its config and fills in what depends on it (the dtype,
    ``max_model_len``). Both raise ``InvalidRequestError``/``ModelNotFoundError``
    with a message naming the setting.
    """

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    served_model_name: Optional[str] = None
    revision: Optional[str] = None
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    block_size: int = 16
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no decode graphs: every step eager
    # KV-cache budget: GiB on CPU, fraction of device memory on GPU, or an exact block count.
    kv_cache_memory_gb: float = 2.0
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: Optional[int] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # None: chosen as vLLM does (see executor_backend).
    distributed_executor_backend: Optional[str] = None
    download_dir: Optional[str] = None  # where fetched and converted models live
    # Weight quantization: None (the checkpoint's precision, or its AWQ/GPTQ method), "int8" (weight-only),
    # "w8a8", "int4", "gguf", "awq" or "gptq" (CPU; activations in float32 or bfloat16).
    quantization: Optional[str] = None
    int4_activations: str = "exact"  # one of INT4_ACTIVATIONS
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # vLLM's shape: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, ...}
    speculative_config: Optional[dict] = None
    # Structured outputs (backend/core/structured_output/compiler.py). vLLM has no bound; 20 s is ~15x the slowest
    # ordinary schema measured (1.2 s at a 49k vocabulary), room for a 256k vocabulary and a busy
    # CPU, while a grammar bomb holds a worker no longer than that.
    grammar_compile_timeout_s: float = 20.0
    grammar_compile_workers: int = 2
    json_max_whitespace: int = 20  # 0: unbounded (xgrammar's own default)
    # Schedule step N+1 while step N runs (backend/engine/inflight.py). None: on with CUDA and one
    # worker, off on the CPU (see FIELD_HELP).
    async_scheduling: Optional[bool] = None
    # Tokens per streamed delta after a sequence's first (backend/engine/stream_interval.py).
    stream_interval: int = 1

    # Filled in by backend.models.resolve.resolve_config (which needs the checkpoint and torch).
    model_path: Optional[Path] = field(default=None, repr=False)
    tokenizer_path: Optional[Path] = field(default=None, repr=False)
    hf_config: Any = field(default=None, repr=False)
    torch_dtype_name: Optional[str] = field(default=None, repr=False)
    device_type: Optional[str] = field(default=None, repr=False)
    cuda_device_count: int = field(default=0, repr=False)  # CUDA devices visible to this process

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> None:
            raise InvalidRequestError(message, param=param)

        if self.dtype not in DTYPES:
            bad("dtype", f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}.")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("device", f"device must be auto, cpu or cuda; got {self.device!r}.")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                bad(name, f"{name} must be at least 1; got {getattr(self, name)}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad("max_model_len", f"max_model_len must be at least 1; got {self.max_model_len}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad("num_kv_blocks", f"num_kv_blocks must be at least 1; got {self.num_kv_blocks}.")
        if self.kv_cache_memory_gb <= 0:
            bad("kv_cache_memory_gb", f"kv_cache_memory_gb must be positive; got {self.kv_cache_memory_gb}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad("gpu_memory_utilization",
                f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}.")
        if not 0 < self.grammar_compile_timeout_s < float("inf"):
            bad("grammar_compile_timeout_s",
                f"grammar_compile_timeout_s must be positive and finite; got {self.grammar_compile_timeout_s}.")
        if not 1 <= self.grammar_compile_workers <= MAX_GRAMMAR_COMPILE_WORKERS:
            bad("grammar_compile_workers", f"grammar_compile_workers must be between 1 and "
                f"{MAX_GRAMMAR_COMPILE_WORKERS}; got {self.grammar_compile_workers}.")
        if not 0 <= self.json_max_whitespace <= MAX_JSON_WHITESPACE:
            bad("json_max_whitespace", f"json_max_whitespace must be between 0 (unbounded) and "
                f"{MAX_JSON_WHITESPACE}; got {self.json_max_whitespace}.")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            bad("stream_interval", f"stream_interval must be between 1 and {MAX_STREAM_INTERVAL}; "
                f"got {self.stream_interval}.")
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # raises, naming the key
        if self.quantization not in (None, *QUANTIZATIONS):
            bad("quantization", f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset); "
                f"got {self.quantization!r}.")
        if self.int4_activations not in INT4_ACTIVATIONS:
            bad("int4_activations", f"int4_activations must be one of {', '.join(INT4_ACTIVATIONS)}; "
                f"got {self.int4_activations!r}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}.")
        if self.distributed_executor_backend not in (None, *EXECUTORS):
            bad("distributed_executor_backend",
                f"distributed_executor_backend must be one of {', '.join(EXECUTORS)}; "
                f"got {self.distributed_executor_backend!r}.")

        if self.async_scheduling:
            if self.speculative_config is not None:
                bad("async_scheduling", "async_scheduling does not work with speculative decoding "
                    "(speculative_config): drafts are proposed from the tokens of the step before.")
            if self.world_size > 1 or self.distributed_executor_backend not in (None, "uni"):
                bad("async_scheduling", "async_scheduling needs a single worker (the uni executor); "
                    "turn it off for tensor or pipeline parallelism and other executors.")

    @property
    def use_async_scheduling(self) -> bool:
        """Whether the engine schedules ahead (resolved: the default depends on the device)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return (self.device_type == "cuda" and self.executor_backend == "uni"
                and self.speculative_config is None)

    @property
    def speculative(self) -> Optional[SpeculativeConfig]:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def kv_cache_dtype_name(self) -> Optional[str]:
        """The torch dtype name of the KV cache (once resolved)."""
        return self.torch_dtype_name if self.kv_cache_dtype == "auto" else "float8_e4m3fn"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The executor to use: as given, else "uni" for one worker, "ray" when this process has
        already initialised Ray or the world needs more GPUs than this machine has, else "mp"."""
        if self.distributed_executor_backend:
            return self.distributed_executor_backend
        if self.world_size == 1:
            return "uni"
        ray = sys.modules.get("ray")  # never imported just to ask
        if ray is not None and ray.is_initialized():
            return "ray"
        if self.device_type == "cuda" and self.cuda_device_count < self.world_size:
            return "ray"
        return "mp"

    @property
    def cache_dir(self) -> Path:
        base = self.download_dir or os.environ.get("TANDEM_CACHE") or "~/.cache/tandem"
        return Path(base).expanduser()

    @classmethod
    def field_names(cls) -> list[str]:
        """The user-settable fields (the ones ``LLM(...)`` and the CLI accept)."""
        return [f.name for f in dataclasses.fields(cls) if f.repr]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, with_model: bool = True) -> None:
        """Add one ``--flag-name`` per field (``model`` as an optional positional)."""
        if with_model:
            parser.add_argument("model", nargs="?", default=None,
                                help="HF directory, .gguf file or hub name (default: SmolLM2-135M-Instruct)")
        add_dataclass_cli_args(parser, cls, [name for name in cls.field_names() if name != "model"], FIELD_HELP)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{name: getattr(args, name) for name in cls.field_names() if hasattr(args, name)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments, rejecting unknown names with a clear error."""
        known = set(cls.field_names())
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(f"Unknown engine argument(s): {', '.join(unknown)}.",
                                      param=unknown[0])
        return cls(**kwargs)
