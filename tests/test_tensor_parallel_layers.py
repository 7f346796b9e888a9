"""Tensor- and pipeline-parallel layers in one process: each rank's shard is exactly its slice of
the checkpoint, and the ranks' partial results combine to the unsplit layer's (the collectives
themselves run in test_distributed.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import backend.distributed as distributed
import backend.models.linear as linear
import backend.models.vocab_parallel as vocab_parallel
from backend.distributed import ParallelState, stage_layers
from backend.models.layers import PPMissingLayer
from backend.models.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                   RowParallelLinear, partition_heads)
from backend.models.loader import iter_weights
from backend.models.registry import parallel_size_problem
from backend.models.resolve import resolve_config
from backend.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(rank, tp, pp=1): build layers as that rank would (no collectives: each rank's
    partial result is returned as is, so the test combines them)."""
    monkeypatch.setattr(linear, "tp_all_reduce", lambda x, state: x)
    monkeypatch.setattr(vocab_parallel, "tp_all_reduce", lambda x, state: x)
    monkeypatch.setattr(vocab_parallel, "tp_gather", lambda x, state: x)

    def set_rank(rank: int, tp: int, pp: int = 1) -> None:
        monkeypatch.setattr(distributed, "_STATE", ParallelState(rank=rank, tp_size=tp, pp_size=pp))

    yield set_rank


@pytest.mark.parametrize("heads, kv_heads, tp, expected", [
    (4, 2, 2, [(0, 2, 0, 1), (2, 2, 1, 1)]),
    (9, 3, 2, [(0, 3, 0, 1), (3, 6, 1, 2)]),  # SmolLM2: whole GQA groups, uneven
    (4, 4, 2, [(0, 2, 0, 2), (2, 2, 2, 2)]),  # MHA (OPT, GPT-2)
    (4, 2, 4, [(0, 1, 0, 1), (1, 1, 0, 1), (2, 1, 1, 1), (3, 1, 1, 1)]),  # KV heads replicated
    (8, 1, 2, [(0, 4, 0, 1), (4, 4, 0, 1)]),  # MQA
])
def test_partition_heads(heads, kv_heads, tp, expected):
    assert [partition_heads(heads, kv_heads, ParallelState(rank=r, tp_size=tp)) for r in range(tp)] == expected


@pytest.mark.parametrize("heads, kv_heads, tp", [(6, 2, 4), (8, 2, 3), (6, 4, 2)])
def test_partition_heads_refuses_what_cannot_be_split(heads, kv_heads, tp):
    with pytest.raises(ValueError):
        for rank in range(tp):
            partition_heads(heads, kv_heads, ParallelState(rank=rank, tp_size=tp))


def test_stage_layers_cover_every_layer_once():
    for num_layers in range(1, 12):
        for pp in range(1, num_layers + 1):
            spans = [stage_layers(num_layers, r, pp) for r in range(pp)]
            assert spans[0][0] == 0 and spans[-1][1] == num_layers
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:]))
            sizes = [end - start for start, end in spans]
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("heads, kv_heads, tp", [(9, 3, 2), (4, 2, 4), (4, 4, 2)])
@pytest.mark.parametrize("fused", [False, True])
def test_qkv_shards_are_the_ranks_heads(as_rank, heads, kv_heads, tp, fused):
    hidden, head_dim = 16, 4
    q = torch.randn(heads * head_dim, hidden)
    k, v = torch.randn(2, kv_heads * head_dim, hidden)
    bias = torch.randn(heads * head_dim + 2 * kv_heads * head_dim)
    x = torch.randn(5, hidden)
    full_q, full_k, full_v = F.linear(x, torch.cat([q, k, v]), bias).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    seen_q = []
    for rank in range(tp):
        as_rank(rank, tp)
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True)
        if fused:
            layer.weight_loader(layer.weight, torch.cat([q, k, v]))
            layer.weight_loader(layer.bias, bias)
        else:
            for shard, tensor in enumerate((q, k, v)):
                layer.weight_loader(layer.weight, tensor, shard)
            for shard, part in enumerate(bias.split([len(q), len(k), len(v)])):
                layer.weight_loader(layer.bias, part, shard)
        q0, nq, kv0, nkv = partition_heads(heads, kv_heads, ParallelState(rank=rank, tp_size=tp))
        out_q, out_k, out_v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        torch.testing.assert_close(out_q, full_q[:, q0 * head_dim:(q0 + nq) * head_dim])
        torch.testing.assert_close(out_k, full_k[:, kv0 * head_dim:(kv0 + nkv) * head_dim])
        torch.testing.assert_close(out_v, full_v[:, kv0 * head_dim:(kv0 + nkv) * head_dim])
        assert layer.q_shard == (q0 * head_dim, nq * head_dim)
        seen_q += range(q0, q0 + nq)
    assert seen_q == list(range(heads))  # every query head on exactly one rank


def test_column_merged_and_row_parallel_combine_to_the_full_layer(as_rank):
    tp, hidden, inner = 2, 12, 8
    gate, up = torch.randn(2, inner, hidden)
    down, down_bias = torch.randn(hidden, inner), torch.randn(hidden)
    fc, fc_bias = torch.randn(inner, hidden), torch.randn(inner)
    x = torch.randn(3, hidden)
    h = F.silu(F.linear(x, gate)) * F.linear(x, up)
    expected_mlp = F.linear(h, down, down_bias)
    partial_sum, fc_parts = 0, []
    for rank in range(tp):
        as_rank(rank, tp)
        gate_up = MergedColumnParallelLinear(hidden, [inner, inner], bias=False)
        gate_up.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight_loader(gate_up.weight, up, 1)
        row = RowParallelLinear(inner, hidden, bias=True)
        row.weight_loader(row.weight, down)
        row.weight_loader(row.bias, down_bias)
        local_gate, local_up = gate_up(x).chunk(2, dim=-1)
        partial_sum = partial_sum + row(F.silu(local_gate) * local_up) - down_bias  # bias: once
        column = ColumnParallelLinear(hidden, inner, bias=True)
        column.weight_loader(column.weight, fc)
        column.weight_loader(column.bias, fc_bias)
        fc_parts.append(column(x))
    torch.testing.assert_close(partial_sum + down_bias, expected_mlp)
    torch.testing.assert_close(torch.cat(fc_parts, dim=-1), F.linear(x, fc, fc_bias))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_embedding_and_tied_lm_head(as_rank, tp):
    vocab, dim = 10, 6  # 10 rows over 4 ranks: 3 + 3 + 3 + 1 and 2 rows of padding
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 9, 3, 5, 2, 6])
    hidden = torch.randn(4, dim)
    embedded, logits = 0, []
    for rank in range(tp):
        as_rank(rank, tp)
        embedding = VocabParallelEmbedding(vocab, dim)
        embedding.weight_loader(embedding.weight, table)
        head = ParallelLMHead(vocab, dim).tie_to(embedding)
        assert head.weight is embedding.weight
        embedded = embedded + embedding(ids)
        logits.append(head(hidden))
    torch.testing.assert_close(embedded, F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], hidden @ table.T)
    assert torch.count_nonzero(torch.cat(logits, dim=-1)[:, vocab:]) == 0  # the padding rows


def test_a_pipeline_stage_loads_only_its_layers_and_a_tied_head(as_rank, tiny_checkpoint):
    """Qwen2's tiny model ties its LM head: the last stage, which has no embedding, loads the
    embedding's tensor into its head; the first stage has no head at all."""
    from backend.models.llama import Qwen2ForCausalLM
    from backend.models.loader import load_hf_config

    model_dir = tiny_checkpoint("qwen2")
    config = load_hf_config(model_dir)
    weights = dict(iter_weights(model_dir))
    as_rank(0, tp=1, pp=2)
    first = Qwen2ForCausalLM(config)
    first.load_weights(iter_weights(model_dir))
    assert isinstance(first.lm_head, PPMissingLayer) and isinstance(first.model.layers[1], PPMissingLayer)
    torch.testing.assert_close(first.model.embed_tokens.weight, weights["model.embed_tokens.weight"])
    as_rank(1, tp=1, pp=2)
    last = Qwen2ForCausalLM(config)
    last.load_weights(iter_weights(model_dir))
    assert isinstance(last.model.embed_tokens, PPMissingLayer) and isinstance(last.model.layers[0], PPMissingLayer)
    torch.testing.assert_close(last.lm_head.weight, weights["model.embed_tokens.weight"])
    torch.testing.assert_close(last.model.layers[1].self_attn.o_proj.weight,
                               weights["model.layers.1.self_attn.o_proj.weight"])
    assert not [n for n, _ in last.named_parameters() if n.startswith("model.layers.0.")]


def test_sizes_the_model_cannot_be_split_by_are_refused_before_any_worker_starts(tiny_checkpoint):
    import transformers as T

    smollm2 = T.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3)
    assert parallel_size_problem(smollm2, 2, 2) is None
    assert parallel_size_problem(smollm2, 4, 1)[0] == "tensor_parallel_size"
    assert parallel_size_problem(smollm2, 1, 31)[0] == "pipeline_parallel_size"
    model = str(tiny_checkpoint("llama"))  # 4 heads, 2 KV heads, 2 layers
    with pytest.raises(InvalidRequestError, match="split over 3 ranks") as error:
        resolve_config(EngineConfig(model=model, tensor_parallel_size=3))
    assert error.value.param == "tensor_parallel_size"
    with pytest.raises(InvalidRequestError, match="larger than the model's 2 layers"):
        resolve_config(EngineConfig(model=model, pipeline_parallel_size=3))
    with pytest.raises(InvalidRequestError, match="'uni' executor runs one worker"):
        resolve_config(EngineConfig(model=model, tensor_parallel_size=2, distributed_executor_backend="uni"))
