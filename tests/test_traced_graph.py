"""The CPU's decode graphs (backend/worker/traced_graph.py): a function's dispatcher ops recorded once and
replayed on refilled buffers, and an engine whose decode steps replay them still HF-exact."""

from __future__ import annotations

import pytest
import torch
from test_correctness import GREEDY, hf_greedy, make_engine, random_prompts, run_engine

from tandem_kernels import ops as kernels
from backend.worker.traced_graph import TracedGraph, compile_replay, torchscript_source, trace_ops


def call_targets(module):
    return [node.target for node in module.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize("compiled", [False, True])
@torch.inference_mode()
def test_replay_reads_the_refilled_buffers_and_repeats_in_place_ops(compiled):
    """The recorded module, and the same ops compiled to TorchScript (what replays run)."""
    x = torch.zeros(3, 4)  # persistent input, refilled between replays
    weight = torch.randn(4, 4)
    total = torch.zeros(3)  # accumulates over calls: in-place ops must be replayed, not folded
    out = torch.zeros(3, 2)

    def step():
        h = torch.relu(x @ weight)  # [3, 4]
        top = h.topk(2, dim=1)  # a tuple result: values, indices
        total.add_(top.values.sum(dim=1))
        out.copy_(top.values + top.indices[:, :1])

    def eager(values):
        h = torch.relu(values @ weight)
        top = h.topk(2, dim=1)
        return top.values + top.indices[:, :1], top.values.sum(dim=1)

    module = trace_ops(step)
    if compiled:
        recorded, module = module, compile_replay(module)
        assert module is not recorded  # compiled, not the fallback
    expected_total = eager(x)[1]
    for _ in range(3):
        x.copy_(torch.randn(3, 4))
        module()
        expected_out, added = eager(x)
        expected_total = expected_total + added
        torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    torch.testing.assert_close(total, expected_total)
    weight.mul_(2)  # read by reference, not copied at capture
    module()
    torch.testing.assert_close(out, eager(x)[0], rtol=0, atol=0)


@torch.inference_mode()
def test_a_fused_kernel_is_recorded_as_one_op():
    assert kernels.cpu.available(), kernels.cpu.unavailable_reason()
    gate_up = torch.randn(2, 16)
    out = torch.empty(2, 8)
    module = trace_ops(lambda: out.copy_(kernels.silu_and_mul(gate_up)))
    # Not the kernel's own allocation, nor the Python dispatch above it: the op, then the copy.
    assert call_targets(module) == [torch.ops.tandem_cpu.silu_and_mul.default, torch.ops.aten.copy_.default]
    gate_up.copy_(torch.randn(2, 16))
    module()
    torch.testing.assert_close(out, kernels.reference.silu_and_mul(gate_up))


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2"])
def test_engine_decode_steps_replay_traced_graphs_and_match_hf_greedy(tiny_checkpoint, arch):
    """Batches of 5, then 3, then 1 running requests: each decode step replays its exact size."""
    model_dir = tiny_checkpoint(arch)
    prompts = random_prompts([1, 5, 9, 17, 3], 384)
    expected = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    engine = make_engine(model_dir, max_num_seqs=8, max_num_batched_tokens=32)
    runner = engine.executor.worker.runner
    assert all(isinstance(g, TracedGraph) for g in runner.graphs.graphs.values())
    assert runner.graphs.sizes == list(range(1, 9))
    assert run_engine(engine, prompts, GREEDY) == expected
    assert run_engine(engine, prompts[:3], GREEDY) == expected[:3]
    assert run_engine(engine, prompts[4:], GREEDY) == expected[4:]
    assert all(g.compiled is not g.module for g in runner.graphs.graphs.values())  # TorchScript replays
    replays = {size: g.num_replays for size, g in runner.graphs.graphs.items()}
    assert replays[5] > 0 and replays[3] > 0 and replays[1] > 0
    # A graph's ops are the fused kernels' and a few views, not the model's Python.
    targets = call_targets(runner.graphs.graphs[1].module)
    assert torch.ops.tandem_cpu.attention_block.default in targets


def test_enforce_eager_leaves_cpu_steps_eager(tiny_checkpoint):
    assert make_engine(tiny_checkpoint("llama"), enforce_eager=True).executor.worker.runner.graphs is None


def test_the_torchscript_source_names_no_tensor_and_falls_back_where_it_cannot_write_an_argument():
    x, y = torch.zeros(2), torch.ones(2)
    first = trace_ops(lambda: x.add_(y, alpha=2.5))
    source, constants = torchscript_source(first)
    assert "torch.ops.aten.add_(c[0], c[1], alpha=2.5)" in source
    assert constants[0] is x and constants[1] is y
    z = torch.zeros(2)
    assert torchscript_source(trace_ops(lambda: z.add_(y, alpha=2.5)))[0] == source  # shared compilation
    odd = trace_ops(lambda: x.add_(y, alpha=float("nan")))  # no literal for a NaN: the recorded module
    assert compile_replay(odd) is odd
