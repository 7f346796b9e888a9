"""OPT (facebook/opt-*) written for paged attention; names mirror the checkpoint's.

Tensor parallel as in llama.py; the learned position table and project_in/out are replicated.
Pipeline stages pass ``hidden_states`` on.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from backend.distributed import get_parallel_state, stage_layers
from backend.models.attention import Attention, AttentionMetadata
from backend.models.layers import PPMissingLayer, load_weights
from backend.models.linear import (ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                   RowParallelLinear)
from backend.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

# OPT's learned position table starts at row 2 (rows 0-1 are a fairseq leftover).
POSITION_OFFSET = 2
_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class OPTAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        head_dim = hidden // num_heads
        bias = config.enable_bias
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, bias=bias)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias, input_shard=self.qkv_proj.q_shard)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              head_dim ** -0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.out_proj(self.attn(self.qkv_proj(x), meta))  # qkv: this rank's q | k | v


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=config.layer_norm_elementwise_affine)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, bias=config.enable_bias)
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
        self.parallel = state = get_parallel_state()
        first, last = state.is_first_stage, state.is_last_stage
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        projected = proj != hidden

        def on(present: bool, make):
            return make() if present else PPMissingLayer()

        self.embed_tokens = on(first, lambda: VocabParallelEmbedding(config.vocab_size, proj))
        self.embed_positions = on(first, lambda: nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, hidden))
        self.project_in = on(first, lambda: ReplicatedLinear(proj, hidden, bias=False)) if projected else None
        self.project_out = on(last, lambda: ReplicatedLinear(hidden, proj, bias=False)) if projected else None
        self.final_layer_norm = None
        if config.do_layer_norm_before and not config._remove_final_layer_norm:
            self.final_layer_norm = on(last, lambda: nn.LayerNorm(
                hidden, elementwise_affine=config.layer_norm_elementwise_affine))
        start, end = stage_layers(config.num_hidden_layers, state.pp_rank, state.pp_size)
        self.layers = nn.ModuleList(OPTDecoderLayer(config) if start <= i < end else PPMissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.local_layers = tuple(self.layers[start:end])

    def forward(self, input_ids, positions, meta, intermediate=None):
        if self.parallel.is_first_stage:
            x = self.embed_tokens(input_ids)  # [num_tokens, word_embed_proj_dim]
            if self.project_in is not None:
                x = self.project_in(x)
            x = x + self.embed_positions(positions + POSITION_OFFSET)  # [num_tokens, hidden]
        else:
            x = intermediate["hidden_states"]
        for layer in self.local_layers:
            x = layer(x, meta)
        if not self.parallel.is_last_stage:
            return {"hidden_states": x}
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
    pp_tensor_names = ("hidden_states",)

    def __init__(self, config: Any, max_model_len: Optional[int] = None) -> None:
        """max_model_len: taken for the registry's common signature; learned position
        embeddings have nothing to size by it."""
        super().__init__()
        self.config = config
        self.pp_hidden_size = config.hidden_size
        self.model = OPTModel(config)
        decoder = self.model.decoder
        self.lm_head = PPMissingLayer()
        if decoder.parallel.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim)
            if decoder.parallel.is_first_stage:
                self.lm_head.tie_to(decoder.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: Optional[dict[str, torch.Tensor]] = None):
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, word_embed_proj_dim]
        (the last stage) or ``{"hidden_states": [num_tokens, hidden]}`` for the next stage."""
        return self.model.decoder(input_ids, positions, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        head_loads_embedding = (isinstance(self.model.decoder.embed_tokens, PPMissingLayer)
                                and not isinstance(self.lm_head, PPMissingLayer))

        def rename(name: str):
            if name.startswith("decoder."):  # older checkpoints lack the "model." prefix
                name = "model." + name
            if name == "model.decoder.embed_tokens.weight" and head_loads_embedding:
                return "lm_head.weight"
            return None if name.startswith("lm_head.") else name

        load_weights(self, weights, self.stacked_params, rename)
