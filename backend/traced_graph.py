"""The CPU's decode graphs: a step's dispatcher ops recorded once, replayed without the model's Python.

On the CPU a batch-1 decode step of the default model spends ~3 ms of ~21 in Python: module
calls, the kernels' dispatch by device, launchers, argument parsing. ``trace_ops(fn)`` runs ``fn``
once under a ``TorchDispatchMode`` that writes every op reaching the dispatcher into a
``torch.fx.Graph``; the resulting ``GraphModule`` replays the same ops, in the same order, with
the same arguments, as one flat generated function, which ``script`` compiles to TorchScript so
that a replay runs no Python between the ops::

    eager    LlamaModel -> layer -> self_attn -> qkv_proj -> method.apply -> kernels.cpu -> op
    traced   w8a8_linear = torch.ops.tandem_cpu.w8a8_linear.default(rms_norm, constant3, ...)

The contract is a CUDA graph's (``DecodeGraphs`` keeps it): ``fn`` reads persistent tensors only
(refilled in place between replays) and makes no host syncs. A tensor that ``fn`` reads but did
not make (weights, KV caches, input buffers) is held by reference and read again at each replay;
Python values (shapes, scalars, branches taken) are frozen at capture. Ops run inside other ops
(the fused kernels' own allocations) are not recorded: replaying the outer op runs them.
"""

from __future__ import annotations

import copy
import operator
import warnings
from typing import Any, Callable

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map


class _OpRecorder(TorchDispatchMode):
    """Runs each op and adds it to ``graph``; tensor arguments become the nodes that made them
    or, for tensors from outside, ``get_attr`` nodes of ``constants``."""

    def __init__(self) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self.constants: dict[str, torch.Tensor] = {}
        self._node_of: dict[int, fx.Node] = {}  # id(tensor) -> the node that yields it
        self._alive: list[torch.Tensor] = []  # keeps every id above unique until tracing ends

    def _node(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        node = self._node_of.get(id(value))
        if node is None:  # made outside fn: replays read the same tensor
            name = f"constant{len(self.constants)}"
            self.constants[name] = value
            node = self._bind(value, self.graph.get_attr(name))
        return node

    def _bind(self, value: Any, node: fx.Node) -> fx.Node:
        if isinstance(value, torch.Tensor):
            self._node_of[id(value)] = node  # an in-place op's result: later reads use this node
            self._alive.append(value)
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    self._bind(item, self.graph.call_function(operator.getitem, (node, i)))
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._bind(out, self.graph.call_function(func, tree_map(self._node, args),
                                                 tree_map(self._node, kwargs)))
        return out


def trace_ops(fn: Callable[[], None]) -> fx.GraphModule:
    """Run ``fn()`` once and return a module whose call repeats its ops (see the module doc)."""
    recorder = _OpRecorder()
    with recorder:
        fn()
    recorder.graph.output(None)
    return fx.GraphModule(recorder.constants, recorder.graph)


def script(module: fx.GraphModule) -> Callable[[], None]:
    """``module``'s ops compiled to TorchScript: a call runs them in TorchScript's interpreter, with
    no Python between the ops (the generated function spends ~6 us of Python and argument
    conversion per op: ~1.4 ms of a batch-32 step's 246). Each op is named by its packet
    (``torch.ops.aten.slice``), which TorchScript resolves to the recorded overload at compile.
    TorchScript is deprecated (torch 2.13 warns, and still compiles): where it fails, ``module``."""
    graph = copy.deepcopy(module.graph)
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            node.target = node.target.overloadpacket
    with warnings.catch_warnings():  # the deprecation, and GraphModule's untyped attributes
        warnings.simplefilter("ignore")
        try:
            return torch.jit.script(fx.GraphModule(module, graph))
        except Exception:  # noqa: BLE001 - any failure to compile leaves the recorded module
            return module


class TracedGraph:
    """``DecodeGraphs``' graph on the CPU: capture records ``fn``'s ops (running it) into
    ``module``, replay runs them compiled (``script``)."""

    def __init__(self, pool=None) -> None:
        self.module: fx.GraphModule | None = None
        self.compiled: Callable[[], None] | None = None
        self.num_replays = 0

    def capture(self, fn: Callable[[], None]) -> None:
        self.module = trace_ops(fn)
        self.compiled = script(self.module)

    def replay(self) -> None:
        self.num_replays += 1
        with torch.jit.optimized_execution(False):  # the ops as recorded: no profiling, no fusion
            self.compiled()
