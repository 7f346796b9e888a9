"""Which model class serves which checkpoint, by ``architectures`` in config.json."""

from __future__ import annotations

import importlib
from typing import Any

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
