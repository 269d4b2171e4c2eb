"""Tensor-parallel sharding strategies: what they are, and the helpers the rules share.

A tensor on a tensor-parallel group of ``t`` ranks is

- ``R``: replicated, every rank holds all of it;
- ``P``: partial, every rank holds a summand and the tensor is their sum;
- ``S(d)``: sharded along dim d, rank r holds the r-th of t equal blocks. ``S(d,g)`` shards
  each of g equal groups along d separately: a fused QKV projection whose output is split into
  three afterwards is ``S(2,3)``, so that every rank holds its slice of q, of k and of v.

An op's ``Strategy`` names the placement it needs of each tensor input and the placement of
its output. The rules that list an op's strategies are in ``autopart.solve.sharding_rules``.

Graphs come in two dialects: fx symbolic traces call torch functions and tensor methods
(``F.linear``, ``x.view(...)``), torch.export graphs call ATen operators
(``aten.linear.default``, ``aten.view.default(x, [...])``). ``op_name`` gives both one name per
operation, and ``argument`` reads an argument by position or keyword, so one rule serves both.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
from torch import fx

from autopart.ir.tensors import TensorMeta
from autopart.passes.annotate import OpGraph
from autopart.ir.placement import PARTIAL, REPLICATE, Placement, shard

__all__ = [
    "Placement", "Strategy", "REPLICATE", "PARTIAL", "op_name", "is_aten", "argument", "local_shape",
    "is_tuple_of_tensors", "meta_of", "constant_of", "folded_number", "divisible", "follow", "output_groups", "shard",
    "UNARY_ELEMENTWISE", "BINARY_ELEMENTWISE",
]  # fmt: skip


@dataclass(frozen=True)
class Strategy:
    output: Placement  # of the output, or of every element of a tuple output
    inputs: tuple[Placement | None, ...]  # per node in ``node.all_input_nodes``; None: not a tensor
    divided: bool  # the op's work is split t ways
    kind: str = ""  # "" (the op itself, on local tensors) or a runtime function that replaces it

    def copies(self, required: Placement, needs_grad: bool) -> bool:
        """Whether an input it takes replicated gets a partial gradient (Megatron's ``f``: an
        all-reduce of that gradient), as every input a split op reads whole does."""
        return required == REPLICATE and self.output != REPLICATE and needs_grad

    def __str__(self) -> str:
        text = f"{self.output}<-{','.join(str(p) if p else '-' for p in self.inputs)}"
        return f"{text}|{self.kind}" if self.kind else text

    @staticmethod
    def parse(text: str) -> Strategy:
        text, _, kind = text.partition("|")
        output, _, inputs = text.partition("<-")
        parsed = tuple(None if p == "-" else Placement.parse(p) for p in re.findall(r"S\(\d+(?:,\d+)?\)|[RP-]", inputs))
        out = Placement.parse(output)
        return Strategy(output=out, inputs=parsed, divided=out != REPLICATE or bool(kind), kind=kind)


def local_shape(shape: tuple[int, ...], placement: Placement, t: int) -> tuple[int, ...]:
    if placement.kind != "S":
        return shape
    local = list(shape)
    local[placement.dim] //= t
    return tuple(local)


_ATEN_NAMES = {"div": "truediv", "to_copy": "to", "unsafe_view": "view", "cross_entropy_loss": "cross_entropy"}
"""ATen operators under the name of the torch function they implement, where the two differ."""


def is_aten(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload)


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return node.op
    if node.target is operator.getitem:
        return "getitem"
    if is_aten(node):  # aten.view.default -> "view"
        name = node.target.overloadpacket.__name__.lstrip("_")
        return _ATEN_NAMES.get(name, name)
    return getattr(node.target, "__name__", str(node.target)).lstrip("_")


def argument(node: fx.Node, position: int, keyword: str, default: object = None) -> object:
    """An argument given by position or by keyword."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(keyword, default)


UNARY_ELEMENTWISE = {
    "gelu", "silu", "relu", "tanh", "sigmoid", "rsqrt", "sqrt", "exp", "log", "neg", "abs", "cos", "sin",
    "float", "contiguous", "clone", "dropout", "to", "type_as", "erf", "square", "pow", "alias",
}  # fmt: skip
BINARY_ELEMENTWISE = {"add", "sub", "mul", "truediv", "iadd", "isub", "imul", "masked_fill", "where", "maximum", "minimum"}


def constant_of(op_graph: OpGraph, value: object) -> object:
    """A node that computed a number (a size, a head count) stands for that number."""
    return op_graph.nodes[value.name].constant if isinstance(value, fx.Node) else value


def folded_number(op_graph: OpGraph, node: fx.Node) -> bool:
    """Whether the generated code writes ``node`` (a size, a head count: a number known at
    compile time) as a constant: its users then no longer read it, and it is dropped as dead,
    with the tensor it measured no longer among its inputs."""
    cost = op_graph.nodes.get(node.name)
    return not (cost is None or cost.constant is None or cost.batch_derived or cost.op in ("placeholder", "get_attr"))


def meta_of(op_graph: OpGraph, node: fx.Node) -> TensorMeta | None:
    return op_graph.nodes[node.name].output


def is_tuple_of_tensors(node: fx.Node, op_graph: OpGraph) -> bool:
    return op_name(node) in ("split", "chunk") and op_graph.nodes[node.name].output is None


def divisible(size: int, t: int, groups: int = 1) -> bool:
    return size % (t * groups) == 0 and size >= t * groups


def follow(
    node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node], *, out_dims: list[int], groups: list[int] = (1,)
) -> list[Strategy]:
    """Output S(d) (or S(d,g)) for each allowed d, every tensor input sharded along its matching dim
    or, where it broadcasts along d, replicated."""
    out = meta_of(op_graph, node)
    if out is None:
        return []
    found = []
    for d in out_dims:
        for g in groups:
            if not divisible(out.shape[d], t, g) or (g > 1 and d != len(out.shape) - 1):
                continue
            required: list[Placement | None] = []
            for arg in inputs:
                meta = meta_of(op_graph, arg)
                if meta is None:
                    required.append(None)
                    continue
                i = d - (len(out.shape) - len(meta.shape))
                required.append(REPLICATE if i < 0 or meta.shape[i] == 1 else shard(i, g))
            if all(p is None or p.kind != "S" or divisible(meta_of(op_graph, a).shape[p.dim], t, g)
                   for a, p in zip(inputs, required)):  # fmt: skip
                found.append(Strategy(output=shard(d, g), inputs=tuple(required), divided=True))
    return found


_CARRIES_LAST_DIM = {"view", "reshape", "contiguous"}
"""Ops after which the fused output's last dim is still whole: the Conv1D pattern views a 2-D
product back to (B, T, 3h) before splitting it."""


def output_groups(node: fx.Node, op_graph: OpGraph) -> list[int]:
    """1, and k when the output is split into k equal parts along its last dim soon after
    (directly, or through elementwise ops such as a bias add or a view that keeps the last dim)."""
    groups = [1]
    out = meta_of(op_graph, node)
    if out is None:
        return groups
    frontier, seen = list(node.users), set()
    while frontier:
        user = frontier.pop()
        if user in seen or len(seen) > 16:
            continue
        seen.add(user)
        name = op_name(user)
        user_meta = meta_of(op_graph, user)
        # by shape alone: under autocast a bias add or a cast changes the dtype, not the layout
        if name in UNARY_ELEMENTWISE | BINARY_ELEMENTWISE and user_meta is not None and user_meta.shape == out.shape:
            frontier.extend(user.users)
        if name in _CARRIES_LAST_DIM and user_meta is not None and user_meta.shape[-1:] == out.shape[-1:]:
            frontier.extend(user.users)
        size = constant_of(op_graph, user.args[1]) if len(user.args) > 1 else None
        if name == "chunk" and isinstance(size, int) and _along_last_dim(user, op_graph):
            groups.append(size)
        if name == "split" and isinstance(size, int) and _along_last_dim(user, op_graph):
            groups.append(out.shape[-1] // size)
    return sorted(set(groups))


def _along_last_dim(user: fx.Node, op_graph: OpGraph) -> bool:
    rank = len(meta_of(op_graph, user.args[0]).shape)
    dim = constant_of(op_graph, argument(user, 2, "dim", 0))
    return isinstance(dim, int) and dim % rank == rank - 1
