"""Which model class serves which checkpoint, by ``architectures`` in config.json."""

from __future__ import annotations

import importlib
from typing import Any, Optional

from torch import nn

# architecture name -> (module under backend.models, class name)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
}

# Configs without ``architectures`` (e.g. converted from GGUF by older versions): by model_type.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "opt": "OPTForCausalLM", "gpt2": "GPT2LMHeadModel"}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for the first architecture of the config that we support."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in _BY_MODEL_TYPE:
        names = [_BY_MODEL_TYPE[hf_config.model_type]]
    for name in names:
        if name in _MODELS:
            module, cls = _MODELS[name]
            return getattr(importlib.import_module(f"backend.models.{module}"), cls)
    raise ValueError(f"Model architecture(s) {names or '(none given)'} are not supported; "
                     f"supported: {', '.join(supported_architectures())}.")


def parallel_size_problem(hf_config: Any, tp_size: int, pp_size: int) -> Optional[tuple[str, str]]:
    """(setting, message) when the model cannot be split tp_size x pp_size ways, else None.

    Attention heads follow ``linear.partition_heads``; MLP features and layers must divide.
    """
    from backend.distributed import ParallelState
    from backend.models.linear import partition_heads

    cfg = hf_config
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    inner = (getattr(cfg, "intermediate_size", None) or getattr(cfg, "ffn_dim", None)
             or getattr(cfg, "n_inner", None) or 4 * cfg.n_embd)
    try:
        for rank in range(tp_size):
            partition_heads(heads, kv_heads, ParallelState(rank=rank, tp_size=tp_size))
    except ValueError as error:
        return "tensor_parallel_size", f"The model cannot be split over {tp_size} ranks: {error}"
    if inner % tp_size:
        return "tensor_parallel_size", (f"The model's MLP size ({inner}) is not divisible by "
                                        f"tensor_parallel_size ({tp_size}).")
    if pp_size > layers:
        return "pipeline_parallel_size", (f"pipeline_parallel_size ({pp_size}) is larger than the "
                                          f"model's {layers} layers.")
    return None
