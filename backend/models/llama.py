"""The Llama family (Llama, Mistral, Qwen2, SmolLM) written for paged attention.

Module names mirror the checkpoint's (``model.layers.N.self_attn.q_proj``...);
q/k/v and gate/up are fused at load time into ``qkv_proj`` and ``gate_up_proj``.
Tensor parallel: heads and the MLP's inner features split over the ranks (linear.py); pipeline
parallel: each stage builds only its layers and passes (hidden_states, residual) on.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from backend.distributed import get_parallel_state, stage_layers
from backend.models.attention import Attention, AttentionMetadata
from backend.models.layers import PPMissingLayer, RMSNorm, RotaryEmbedding, load_weights
from backend.models.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from backend.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


def llama_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = llama_head_dim(config)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden,
                                        bias=getattr(config, "attention_bias", False),
                                        input_shard=self.qkv_proj.q_shard)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              head_dim ** -0.5, rotary)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size] (this rank's heads)
        return self.o_proj(self.attn(qkv, meta, positions))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Unsupported activation {config.hidden_act!r} (only silu).")
        bias = getattr(config, "mlp_bias", False)
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_gated(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        """Pre-norm block; the residual stream is carried separately (fused add + norm)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, max_positions: int) -> None:
        super().__init__()
        self.parallel = state = get_parallel_state()
        start, end = stage_layers(config.num_hidden_layers, state.pp_rank, state.pp_size)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if state.is_first_stage else PPMissingLayer())
        # One cos/sin table for every layer (they share the rotary config): [max_positions, rotary_dim].
        self.rotary_emb = RotaryEmbedding(config, llama_head_dim(config), max_positions)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, qkv_bias, self.rotary_emb) if start <= i < end
                                    else PPMissingLayer() for i in range(config.num_hidden_layers))
        self.local_layers = tuple(self.layers[start:end])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if state.is_last_stage else PPMissingLayer()

    def forward(self, input_ids, positions, meta, intermediate=None):
        if self.parallel.is_first_stage:
            x, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden]
        else:
            x, residual = intermediate["hidden_states"], intermediate["residual"]
        for layer in self.local_layers:
            x, residual = layer(positions, x, residual, meta)
        if not self.parallel.is_last_stage:
            return {"hidden_states": x, "residual": residual}
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Also Mistral and SmolLM; Qwen2 is this with biases on q/k/v."""

    qkv_bias = False
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    # What one pipeline stage hands the next: [num_tokens, hidden_size] each.
    pp_tensor_names = ("hidden_states", "residual")

    def __init__(self, config: Any, max_model_len: Optional[int] = None) -> None:
        """max_model_len: the longest sequence the engine runs (its positions are below it); it
        sizes the rotary table. None: the config's max_position_embeddings."""
        super().__init__()
        self.config = config
        self.pp_hidden_size = config.hidden_size
        max_positions = config.max_position_embeddings if max_model_len is None else max_model_len
        if not isinstance(max_positions, int) or max_positions < 1:
            raise ValueError(f"max_model_len must be a positive int; got {max_positions!r}")
        self.model = LlamaModel(config, self.qkv_bias or getattr(config, "attention_bias", False), max_positions)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        self.lm_head = PPMissingLayer()
        if self.model.parallel.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings and self.model.parallel.is_first_stage:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: Optional[dict[str, torch.Tensor]] = None):
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden] (the last
        stage) or the ``pp_tensor_names`` tensors for the next stage."""
        return self.model(input_ids, positions, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden: [num_rows, hidden] -> logits [num_rows, vocab] (None on TP ranks other than 0)."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # A tied head on a stage without the embedding loads the embedding's tensor itself.
        head_loads_embedding = (self.tie_word_embeddings and isinstance(self.model.embed_tokens, PPMissingLayer)
                                and not isinstance(self.lm_head, PPMissingLayer))

        def rename(name: str):
            if "rotary_emb.inv_freq" in name:
                return None
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None
            if name == "model.embed_tokens.weight" and head_loads_embedding:
                return "lm_head.weight"
            return name

        load_weights(self, weights, self.stacked_params, rename)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class MistralForCausalLM(LlamaForCausalLM):
    pass
