"""Building blocks shared by the models: norms, rotary, activations, weight loading.

Linear layers (plain, fused and tensor-parallel) are in linear.py, the vocabulary-parallel
embedding and LM head in vocab_parallel.py.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from tandem_kernels import ops as kernels
from backend.models.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """x: [num_tokens, hidden]. With ``residual``: returns (norm(x + residual), x + residual)."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_parameters(config: Any) -> dict:
    """The config's rotary settings as one dict (transformers 5 ``rope_parameters`` or 4.x fields)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table.

    The frequencies come from transformers' own rope functions (default,
    linear, llama3, yarn, ...), so they equal the oracle's bit for bit.
    The table is max_positions x rotary_dim fp32 (64 MiB at 131k positions and head dim 128):
    a model builds one per distinct rotary config, sized to the engine's max_model_len, and
    hands it to every layer.
    """

    is_neox = True  # the Llama family rotates halves

    def __init__(self, config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        params = rope_parameters(config)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
            exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim
            inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponent), 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic rope scaling depends on the sequence length; it is not supported.")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            from backend.models.loader import transformers_config

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](transformers_config(config))
        # [max_positions, rotary_dim]: cos | sin, fp32 whatever the model dtype
        self.register_buffer("cos_sin_cache", kernels.rotary_cos_sin(inv_freq, max_positions, scaling),
                             persistent=False)

    def _apply(self, fn, recurse=True):
        # Keep the table in fp32 when the model is cast to bf16 (only move devices).
        cache = self.cos_sin_cache
        super()._apply(fn, recurse)
        self.cos_sin_cache = cache.to(self.cos_sin_cache.device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotated (q, k); ``Attention`` applies the table itself, fused with the rest."""
        return kernels.apply_rotary(positions, q, k, self.cos_sin_cache, self.head_dim, self.is_neox)


class PPMissingLayer(nn.Module):
    """Stands in for a module that lives on another pipeline stage: no weights, never called.

    It keeps the module tree (and so the checkpoint names) the same on every stage;
    ``load_weights`` skips the checkpoint tensors that belong under it.
    """

    def forward(self, *args, **kwargs):
        raise RuntimeError("This module lives on another pipeline stage.")


# checkpoint name fragment -> (fused parameter fragment, shard index)
StackedParams = dict[str, tuple[str, int]]


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 stacked: StackedParams = None,
                 rename: Callable[[str], Optional[str]] = lambda name: name) -> None:
    """Copy checkpoint tensors into ``model``'s parameters (this rank's shard of each).

    ``rename`` maps a checkpoint name to a parameter name (None: skip it); ``stacked`` routes
    e.g. ``q_proj`` into shard 0 of ``qkv_proj``. A module's ``weight_loader(param, tensor,
    shard_id)`` picks its rank's slice; modules without one take the tensor whole. Tensors under
    a ``PPMissingLayer`` (another stage's) are skipped unread, and so is the weight of a layer
    marked ``weight_is_packed`` (held packed instead: gguf_packed.py, int4_checkpoints.py). Every
    parameter (every shard of a fused one, see ``shard_ids``) must be loaded, or a ValueError names
    the missing ones.
    """
    params = dict(model.named_parameters())
    elsewhere = tuple(name + "." for name, module in model.named_modules()
                      if isinstance(module, PPMissingLayer))
    loaded: set[tuple[str, Optional[int]]] = set()
    stacked = stacked or {}
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None or name.startswith(elsewhere):
            continue
        shard = None
        for fragment, (fused, shard_id) in stacked.items():
            if f".{fragment}." in name:
                name, shard = name.replace(f".{fragment}.", f".{fused}."), shard_id
                break
        if name not in params:
            raise ValueError(f"Checkpoint tensor {ckpt_name!r} matches no parameter of "
                             f"{type(model).__name__}.")
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if name.endswith(".weight") and getattr(module, "weight_is_packed", False):
            continue  # served from its packed form: never read, so never resident
        loader = getattr(module, "weight_loader", None)
        try:
            if loader is not None:
                loader(params[name], tensor, shard)
            else:
                default_weight_loader(params[name], tensor)
        except ValueError as error:
            raise ValueError(f"Checkpoint tensor {ckpt_name!r}: {error}.") from None
        loaded.add((name, shard))
    missing = []
    for name in params:
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if name.endswith(".weight") and getattr(module, "weight_is_packed", False):
            continue  # held in a packed form instead (backend/models/int4_checkpoints.py)
        shard_ids = getattr(module, "shard_ids", None)
        if shard_ids and (name, None) not in loaded:
            missing += [f"{name}#{i}" for i in shard_ids if (name, i) not in loaded]
        elif not shard_ids and (name, None) not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(f"The checkpoint lacks weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
