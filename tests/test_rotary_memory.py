"""The rotary cos/sin table: one per model, max_model_len rows (not one per layer at
max_position_embeddings rows: 512 MiB for a Llama-3.2-1B, 2 GiB for a 32-layer head-dim-128 model)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from backend.models.layers import RotaryEmbedding
from backend.models.llama import LlamaForCausalLM


def long_context_config(**overrides) -> LlamaConfig:
    """16 layers and 131,072 positions like Llama-3.2-1B, narrow enough to build in a moment."""
    values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=16, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=131072,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    values.update(overrides)
    return LlamaConfig(**values)


def rotary_tables(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The distinct cos/sin tables the model holds, by storage address."""
    return {m.cos_sin_cache.untyped_storage().data_ptr(): m.cos_sin_cache
            for m in model.modules() if isinstance(m, RotaryEmbedding)}


def test_one_table_per_model_sized_to_max_model_len():
    model = LlamaForCausalLM(long_context_config(), max_model_len=2048)
    tables = list(rotary_tables(model).values())
    assert len(tables) == 1
    head_dim = 64 // 4
    assert tables[0].shape == (2048, head_dim) and tables[0].dtype == torch.float32
    assert sum(t.untyped_storage().nbytes() for t in tables) == 2048 * head_dim * 4  # 128 KiB
    # Every layer attends with that one table.
    assert all(layer.self_attn.attn.rotary.cos_sin_cache is tables[0] for layer in model.model.layers)


def test_shared_table_equals_a_full_length_one():
    """Sizing to max_model_len keeps each row: position p rotates the same as before."""
    config = long_context_config(num_hidden_layers=2)
    short = rotary_tables(LlamaForCausalLM(config, max_model_len=300))
    full = RotaryEmbedding(config, 16, 4096).cos_sin_cache
    (table,) = short.values()
    assert torch.equal(table, full[:300])


def test_without_max_model_len_the_config_bounds_the_table():
    model = LlamaForCausalLM(long_context_config(num_hidden_layers=2, max_position_embeddings=512))
    (table,) = rotary_tables(model).values()
    assert table.shape[0] == 512
    with pytest.raises(ValueError, match="max_model_len"):
        LlamaForCausalLM(long_context_config(num_hidden_layers=2), max_model_len=0)
