"""GPT-2 written for paged attention; names mirror the checkpoint's.

GPT-2 checkpoints store their linears as Conv1D ([in, out]); they are
transposed into nn.Linear's [out, in] at load time. ``c_attn`` holds q | k | v fused, which
QKVParallelLinear splits per rank; stages pass ``hidden_states`` on.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from backend.distributed import get_parallel_state, stage_layers
from backend.models.attention import Attention, AttentionMetadata
from backend.models.layers import PPMissingLayer, load_weights
from backend.models.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from backend.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_ACTIVATIONS = {"gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "gelu": F.gelu, "relu": F.relu}


class GPT2Attention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.n_embd
        num_heads = config.n_head
        head_dim = hidden // num_heads
        if config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
            raise ValueError("GPT-2 variants with per-layer attention scaling are not supported.")
        scale = head_dim ** -0.5 if config.scale_attn_weights else 1.0
        self.c_attn = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, bias=True)
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True, input_shard=self.c_attn.q_shard)
        self.attn = Attention(self.c_attn.num_heads, self.c_attn.num_kv_heads, head_dim, scale)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.c_proj(self.attn(self.c_attn(x), meta))  # qkv: this rank's q | k | v


class GPT2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = ColumnParallelLinear(config.n_embd, inner, bias=True)
        self.c_proj = RowParallelLinear(inner, config.n_embd, bias=True)
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
        self.parallel = state = get_parallel_state()
        first, last = state.is_first_stage, state.is_last_stage
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd) if first else PPMissingLayer()
        self.wpe = nn.Embedding(config.n_positions, config.n_embd) if first else PPMissingLayer()
        start, end = stage_layers(config.n_layer, state.pp_rank, state.pp_size)
        self.h = nn.ModuleList(GPT2Block(config) if start <= i < end else PPMissingLayer()
                               for i in range(config.n_layer))
        self.local_blocks = tuple(self.h[start:end])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon) if last else PPMissingLayer()

    def forward(self, input_ids, positions, meta, intermediate=None):
        if self.parallel.is_first_stage:
            x = self.wte(input_ids) + self.wpe(positions)  # [num_tokens, n_embd]
        else:
            x = intermediate["hidden_states"]
        for block in self.local_blocks:
            x = block(x, meta)
        if not self.parallel.is_last_stage:
            return {"hidden_states": x}
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """The LM head is tied to ``wte``."""

    pp_tensor_names = ("hidden_states",)

    def __init__(self, config: Any, max_model_len: Optional[int] = None) -> None:
        """max_model_len: taken for the registry's common signature; learned position
        embeddings have nothing to size by it."""
        super().__init__()
        self.config = config
        self.pp_hidden_size = config.n_embd
        self.transformer = GPT2Model(config)
        self.lm_head = PPMissingLayer()
        if self.transformer.parallel.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.n_embd)
            if self.transformer.parallel.is_first_stage:
                self.lm_head.tie_to(self.transformer.wte)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: Optional[dict[str, torch.Tensor]] = None):
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, n_embd] (the last
        stage) or ``{"hidden_states": ...}`` for the next stage."""
        return self.transformer(input_ids, positions, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        head_loads_embedding = (isinstance(self.transformer.wte, PPMissingLayer)
                                and not isinstance(self.lm_head, PPMissingLayer))

        def transposed():
            for name, tensor in weights:
                yield name, tensor.t() if name.endswith(_CONV1D) else tensor

        def rename(name: str):
            if name.startswith("lm_head.") or name.endswith((".attn.bias", ".attn.masked_bias")):
                return None
            name = name if name.startswith("transformer.") else "transformer." + name
            return "lm_head.weight" if name == "transformer.wte.weight" and head_loads_embedding else name

        load_weights(self, transposed(), rename=rename)
