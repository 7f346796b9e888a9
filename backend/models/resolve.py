"""Resolving an ``EngineConfig`` against its checkpoint and device: what the pure-Python config
cannot know by itself (the model's path and HF config, the device, the dtype, max_model_len), and
the light copy of it that worker processes receive."""

from __future__ import annotations

import dataclasses

import torch

from backend.models.gguf_packed import MODEL_TYPES
from backend.models.int4_checkpoints import METHODS as CHECKPOINT_METHODS, QuantizationConfigError, checkpoint_method
from backend.models.linear_methods import GPU_QUANTIZATIONS
from backend.models.loader import PlainModelConfig, load_hf_config, resolve_model, resolve_tokenizer
from backend.models.registry import parallel_size_problem
from backend.types.config import INT4_QUANTIZATIONS, EngineConfig, cpu_has_native_bf16
from backend.types.errors import InvalidRequestError


def resolve_config(config: EngineConfig) -> EngineConfig:
    """Find the checkpoint and fill in what depends on it, in place; returns ``config``. Idempotent.
    Raises ``InvalidRequestError`` (naming the setting) for a setting the model or device refuses."""
    if config.model_path is not None:
        return config
    config.model_path = resolve_model(config.model, cache_dir=config.cache_dir, revision=config.revision)
    config.tokenizer_path = resolve_tokenizer(config.tokenizer, config.model_path, config.cache_dir)
    if config.served_model_name is None:
        config.served_model_name = config.model or "SmolLM2-135M-Instruct"
    config.hf_config = load_hf_config(config.model_path)
    _resolve_checkpoint_quantization(config)
    _resolve_device_and_dtype(config)
    _check_gguf_quantization(config)
    _resolve_max_model_len(config)
    _check_parallel_sizes(config)
    if config.enable_chunked_prefill is False and config.max_num_batched_tokens < config.max_model_len:
        raise InvalidRequestError(
            f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least "
            f"max_model_len ({config.max_model_len}) when chunked prefill is off.",
            param="max_num_batched_tokens")
    return config


def load_cpu_kernels_early(config: EngineConfig) -> None:
    """For an engine that will run on the CPU: find, load or build the fused CPU kernels in a
    background thread now (``tandem_kernels.cpu.load_in_background``), so that a first build (~30 s
    on 2 cores) overlaps with finding, fetching and converting the model; the worker waits for it
    before loading weights. A CUDA engine never builds them."""
    import tandem_kernels.cpu

    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return
    tandem_kernels.cpu.load_in_background()


def config_for_workers(config: EngineConfig) -> EngineConfig:
    """A resolved config, light to send to worker processes (see PlainModelConfig)."""
    return dataclasses.replace(config, hf_config=PlainModelConfig(config.hf_config, config.model_path))


def _resolve_device_and_dtype(config: EngineConfig) -> None:
    cuda = torch.cuda.is_available()
    config.cuda_device_count = torch.cuda.device_count() if cuda else 0
    if config.device == "auto":
        config.device_type = "cuda" if cuda else "cpu"
    else:
        config.device_type = config.device
    if config.device_type == "cuda" and not cuda:
        raise InvalidRequestError("device='cuda' was asked for but no CUDA device is visible.", param="device")
    if config.dtype != "auto":
        config.torch_dtype_name = config.dtype
    elif config.device_type == "cuda" or cpu_has_native_bf16():
        config.torch_dtype_name = "bfloat16"
    else:
        config.torch_dtype_name = "float32"
    _check_quantization_device(config)
    if config.kv_cache_dtype != "auto" and config.device_type != "cpu":
        raise InvalidRequestError(
            f"kv_cache_dtype={config.kv_cache_dtype!r} is implemented for the CPU; the GPU's "
            "attention kernels read caches in the model's dtype only.", param="kv_cache_dtype")


def _check_quantization_device(config: EngineConfig) -> None:
    """Quantized weights run on the CPU with float32 or bfloat16 activations; the 4-bit ones
    (GPU_QUANTIZATIONS: the int4 layout's Triton kernel) also on CUDA with bfloat16 or float16.
    int8 activations (``int4_activations``) are the CPU's 4-bit matmuls' only."""
    if config.int4_activations != "exact" and (config.quantization not in INT4_QUANTIZATIONS
                                               or config.device_type != "cpu"):
        raise InvalidRequestError(
            f"int4_activations={config.int4_activations!r} is implemented for 4-bit weights on the CPU "
            f"(quantization {', '.join(INT4_QUANTIZATIONS)}); got quantization={config.quantization!r} on "
            f"{config.device_type}.", param="int4_activations")
    if config.quantization is None:
        return
    if config.device_type == "cpu" and config.torch_dtype_name in ("float32", "bfloat16"):
        return
    if (config.device_type == "cuda" and config.quantization in GPU_QUANTIZATIONS
            and config.torch_dtype_name in ("bfloat16", "float16")):
        return
    raise InvalidRequestError(
        f"quantization={config.quantization!r} is implemented for the CPU with float32 or bfloat16 activations"
        f"{'' if config.quantization in GPU_QUANTIZATIONS else ' only'}"
        f"{', and for CUDA with bfloat16 or float16' if config.quantization in GPU_QUANTIZATIONS else ''}; "
        f"got device {config.device_type}, dtype {config.torch_dtype_name}.", param="quantization")


def _resolve_checkpoint_quantization(config: EngineConfig) -> None:
    """An AWQ / GPTQ checkpoint (its config.json's quantization_config) sets ``quantization`` to its
    method; another value asked for it, awq / gptq asked for a checkpoint without it, an option the
    CPU kernels do not serve, or more than one worker is refused, naming it."""
    try:
        method = checkpoint_method(config.hf_config)
    except QuantizationConfigError as error:
        raise InvalidRequestError(f"{config.model}: {error}.", param="quantization") from None
    if method is None:
        if config.quantization in CHECKPOINT_METHODS:
            raise InvalidRequestError(
                f"quantization={config.quantization!r} serves checkpoints quantized with it; {config.model!r} "
                "has no quantization_config in its config.json.", param="quantization")
        return
    if config.quantization not in (None, method):
        raise InvalidRequestError(
            f"{config.model!r} holds {method.upper()} 4-bit weights (its config.json's quantization_config); "
            f"quantization={config.quantization!r} does not apply to it: leave quantization unset or pass "
            f"{method!r}.", param="quantization")
    config.quantization = method
    if config.world_size != 1:
        raise InvalidRequestError(f"quantization={method!r} runs on one worker (tensor_parallel_size=1, "
                                  "pipeline_parallel_size=1).", param="quantization")


def _check_gguf_quantization(config: EngineConfig) -> None:
    """quantization="gguf" reads the packed tensors of the .gguf file model= names, whole (one worker)."""
    if config.quantization != "gguf":
        return
    if not (config.model or "").lower().endswith(".gguf"):
        raise InvalidRequestError(f"quantization='gguf' serves a .gguf file's packed weights; model={config.model!r} "
                                  "is not one.", param="quantization")
    if config.tensor_parallel_size != 1:
        raise InvalidRequestError("quantization='gguf' runs on one worker (tensor_parallel_size=1).",
                                  param="quantization")
    if config.hf_config.model_type not in MODEL_TYPES:
        raise InvalidRequestError(f"quantization='gguf' serves Llama-family GGUF files ({', '.join(MODEL_TYPES)}); "
                                  f"this one is {config.hf_config.model_type!r}.", param="quantization")


def _check_parallel_sizes(config: EngineConfig) -> None:
    """Refuse TP/PP sizes the model cannot be split by, before any worker starts."""
    problem = parallel_size_problem(config.hf_config, config.tensor_parallel_size, config.pipeline_parallel_size)
    if problem is not None:
        raise InvalidRequestError(problem[1], param=problem[0])
    if config.executor_backend == "uni" and config.world_size > 1:
        raise InvalidRequestError(
            f"The 'uni' executor runs one worker, but tensor_parallel_size x "
            f"pipeline_parallel_size is {config.world_size}; use 'mp' (one machine) or 'ray'.",
            param="distributed_executor_backend")


def _resolve_max_model_len(config: EngineConfig) -> None:
    hf_config = config.hf_config
    limit = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            limit = value
            break
    if config.max_model_len is None:
        if limit is None:
            raise InvalidRequestError("The model's config gives no maximum length; pass max_model_len.",
                                      param="max_model_len")
        config.max_model_len = limit
    elif limit is not None and config.max_model_len > limit:
        raise InvalidRequestError(
            f"max_model_len ({config.max_model_len}) is larger than the model's maximum "
            f"length ({limit}).", param="max_model_len")
