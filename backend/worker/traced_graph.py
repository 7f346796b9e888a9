"""The CPU's decode graphs: a step's dispatcher ops recorded once, replayed without the model's Python.

On the CPU a batch-1 decode step of the default model spends ~3 ms of ~21 in Python: module
calls, the kernels' dispatch by device, launchers, argument parsing. ``trace_ops(fn)`` runs ``fn``
once under a ``TorchDispatchMode`` that writes every op reaching the dispatcher into a
``torch.fx.Graph``; the resulting ``GraphModule`` replays the same ops, in the same order, with
the same arguments, as one flat generated function; ``compile_replay`` writes the same ops as
TorchScript, so that a replay runs no Python between them::

    eager    LlamaModel -> layer -> self_attn -> qkv_proj -> method.apply -> kernels.cpu -> op
    traced   w8a8_linear = torch.ops.tandem_cpu.w8a8_linear.default(rms_norm, constant3, ...)

The contract is a CUDA graph's (``DecodeGraphs`` keeps it): ``fn`` reads persistent tensors only
(refilled in place between replays) and makes no host syncs. A tensor that ``fn`` reads but did
not make (weights, KV caches, input buffers) is held by reference and read again at each replay;
Python values (shapes, scalars, branches taken) are frozen at capture. Ops run inside other ops
(the fused kernels' own allocations) are not recorded: replaying the outer op runs them.
"""

from __future__ import annotations

import functools
import math
import operator
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


def _literal(value: Any, names: dict) -> str:
    """TorchScript source for an op argument: a node's variable, or a constant written out."""
    if isinstance(value, fx.Node):
        return names[value]
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)  # the shortest text that reads back as the same double
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(item, names) for item in value) + "]"
    raise TypeError(f"no TorchScript literal for {type(value).__name__}")


def torchscript_source(module: fx.GraphModule) -> tuple[str, list[torch.Tensor]]:
    """``module``'s ops as the TorchScript function ``replay(c: List[Tensor])``, and the tensors it
    reads from outside (``c``). Each op is called by its packet (``torch.ops.aten.slice``), which
    TorchScript resolves to the recorded overload when it compiles. The source names no tensor, so
    graphs of the same shapes share it (and its compilation)."""
    constants: list[torch.Tensor] = []
    names: dict[fx.Node, str] = {}
    lines = ["def replay(c: List[Tensor]):"]
    for i, node in enumerate(module.graph.nodes):
        if node.op == "get_attr":
            names[node] = f"c[{len(constants)}]"
            constants.append(getattr(module, node.target))
        elif node.op == "call_function":
            if node.target is operator.getitem:
                expr = f"{names[node.args[0]]}[{int(node.args[1])}]"
            else:
                packet = node.target.overloadpacket  # an OpOverload: _OpRecorder records no other
                args = [_literal(a, names) for a in node.args]
                args += [f"{key}={_literal(a, names)}" for key, a in node.kwargs.items()]
                expr = f"torch.ops.{packet._qualified_op_name.replace('::', '.')}({', '.join(args)})"
            names[node] = f"v{i}"
            lines.append(f"    v{i} = {expr}")
    lines.append("    return None")
    return "\n".join(lines) + "\n", constants


@functools.lru_cache(maxsize=256)
def _compile(source: str) -> torch.jit.CompilationUnit:
    return torch.jit.CompilationUnit(source)


def compile_replay(module: fx.GraphModule) -> Callable[[], None]:
    """A call that runs ``module``'s ops in TorchScript's interpreter, with no Python between them:
    the generated function of ``module`` spends ~6 us of Python and argument conversion per op
    (~1.4 ms of a batch-32 step's 246 ops); compiling takes ~40 ms for the default model's graph.
    Where the graph holds an argument TorchScript cannot write, or does not compile: ``module``."""
    try:
        source, constants = torchscript_source(module)
        unit = _compile(source)
    except (TypeError, RuntimeError, AttributeError):
        return module

    def replay() -> None:
        with torch.jit.optimized_execution(False):  # the ops as recorded: no profiling, no fusion
            unit.replay(constants)

    return replay


class TracedGraph:
    """``DecodeGraphs``' graph on the CPU: capture records ``fn``'s ops (running it) into
    ``module``; replay runs them compiled (``compile_replay``)."""

    kind = "CPU traced graphs"
    # Recording sets no process-wide mode (the dispatch mode is this thread's only) and runs the
    # step for real, so a batch size's first step can record it while serving: nothing at start-up.
    captured_on_first_use = True

    def __init__(self, pool=None) -> None:
        self.module: fx.GraphModule | None = None
        self.compiled: Callable[[], None] | None = None
        self.num_replays = 0

    def capture(self, fn: Callable[[], None]) -> None:
        self.module = trace_ops(fn)
        self.compiled = compile_replay(self.module)

    def replay(self) -> None:
        self.num_replays += 1
        self.compiled()
