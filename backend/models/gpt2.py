"""GPT-2 written for paged attention; names mirror the checkpoint's.

GPT-2 checkpoints store their linears as Conv1D ([in, out]); they are
transposed into nn.Linear ([out, in]) at load time.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from backend.models.attention import Attention, AttentionMetadata
from backend.models.layers import load_weights

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_ACTIVATIONS = {"gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "gelu": F.gelu, "relu": F.relu}


class GPT2Attention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = hidden // self.num_heads
        if config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
            raise ValueError("GPT-2 variants with per-layer attention scaling are not supported.")
        scale = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.c_proj(self.attn(self.c_attn(x), meta))  # qkv: [num_tokens, 3 * n_embd]


class GPT2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, inner)
        self.c_proj = nn.Linear(inner, config.n_embd)
        if config.activation_function not in _ACTIVATIONS:
            raise ValueError(f"Unsupported GPT-2 activation {config.activation_function!r}.")
        self.act = _ACTIVATIONS[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, positions, meta):
        x = self.wte(input_ids) + self.wpe(positions)  # [num_tokens, n_embd]
        for block in self.h:
            x = block(x, meta)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """The LM head is tied to ``wte``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, n_embd]."""
        return self.transformer(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.transformer.wte.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def transposed():
            for name, tensor in weights:
                yield name, tensor.t() if name.endswith(_CONV1D) else tensor

        def rename(name: str):
            if name.startswith("lm_head.") or name.endswith((".attn.bias", ".attn.masked_bias")):
                return None
            return name if name.startswith("transformer.") else "transformer." + name

        load_weights(self, transposed(), rename=rename)
