"""OPT (facebook/opt-*) written for paged attention; names mirror the checkpoint's."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from backend.models.attention import Attention, AttentionMetadata
from backend.models.layers import MergedLinear, load_weights

# OPT's learned position table starts at row 2 (rows 0-1 are a fairseq leftover).
POSITION_OFFSET = 2
_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class OPTAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        bias = config.enable_bias
        self.qkv_proj = MergedLinear(hidden, [hidden] * 3, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.out_proj(self.attn(self.qkv_proj(x), meta))  # qkv: [num_tokens, 3 * hidden]


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=config.layer_norm_elementwise_affine)
        self.fc1 = nn.Linear(hidden, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = nn.Linear(config.ffn_dim, hidden, bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=config.layer_norm_elementwise_affine)
        if config.activation_function not in _ACTIVATIONS:
            raise ValueError(f"Unsupported OPT activation {config.activation_function!r}.")
        self.act = _ACTIVATIONS[config.activation_function]

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        residual = x
        if self.pre_norm:
            x = self.self_attn_layer_norm(x)
        x = residual + self.self_attn(x, meta)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        residual = x
        if self.pre_norm:
            x = self.final_layer_norm(x)
        x = residual + self.fc2(self.act(self.fc1(x)))
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x


class OPTDecoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, proj)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, hidden)
        self.project_in = nn.Linear(proj, hidden, bias=False) if proj != hidden else None
        self.project_out = nn.Linear(hidden, proj, bias=False) if proj != hidden else None
        self.final_layer_norm = None
        if config.do_layer_norm_before and not config._remove_final_layer_norm:
            self.final_layer_norm = nn.LayerNorm(
                hidden, elementwise_affine=config.layer_norm_elementwise_affine)
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)  # [num_tokens, word_embed_proj_dim]
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)  # [num_tokens, hidden]
        for layer in self.layers:
            x = layer(x, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    """The LM head is always tied to the token embedding in OPT."""

    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, word_embed_proj_dim]."""
        return self.model.decoder(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.decoder.embed_tokens.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str):
            if name.startswith("decoder."):  # older checkpoints lack the "model." prefix
                name = "model." + name
            return None if name.startswith("lm_head.") else name

        load_weights(self, weights, self.stacked_params, rename)
