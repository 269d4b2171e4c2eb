"""Tensor-parallel sharding strategies per op, at the level of torch functions in the fx graph.

A tensor on a tensor-parallel group of ``t`` ranks is

- ``R``: replicated, every rank holds all of it;
- ``P``: partial, every rank holds a summand and the tensor is their sum;
- ``S(d)``: sharded along dim d, rank r holds the r-th of t equal blocks. ``S(d,g)`` shards
  each of g equal groups along d separately: a fused QKV projection whose output is split into
  three afterwards is ``S(2,3)``, so that every rank holds its slice of q, of k and of v.

An op's ``Strategy`` names the placement it needs of each tensor input and the placement of
its output. Every op has the replicated strategy (all R, the whole op on every rank), so what
cannot be split stays replicated and is never silently wrong. The others follow DTensor's and
Megatron-LM's rules: column- and row-parallel linear, vocabulary- and hidden-parallel
embedding, vocabulary-parallel cross-entropy, ops that follow their inputs along dims they do
not reduce over, and views that carry a sharded dim through a reshape.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import fx

from autopart.annotate import OpGraph, TensorMeta
from autopart.placement import PARTIAL, REPLICATE, Placement, shard

__all__ = ["Placement", "Strategy", "REPLICATE", "PARTIAL", "op_name", "strategies", "local_shape", "is_tuple_of_tensors"]


@dataclass(frozen=True)
class Strategy:
    output: Placement  # of the output, or of every element of a tuple output
    inputs: tuple[Placement | None, ...]  # per node in ``node.all_input_nodes``; None: not a tensor
    divided: bool  # the op's work is split t ways
    kind: str = ""  # "" (the op itself, on local tensors) or a runtime function that replaces it

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


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return node.op
    if node.target is operator.getitem:
        return "getitem"
    return getattr(node.target, "__name__", str(node.target)).lstrip("_")


UNARY_ELEMENTWISE = {
    "gelu", "silu", "relu", "tanh", "sigmoid", "rsqrt", "sqrt", "exp", "log", "neg", "abs", "cos", "sin",
    "float", "contiguous", "clone", "dropout", "to", "type_as", "erf", "square", "pow",
}  # fmt: skip
BINARY_ELEMENTWISE = {"add", "sub", "mul", "truediv", "iadd", "isub", "imul", "masked_fill", "where", "maximum", "minimum"}
LINEAR_IN_PARTIAL = {"add", "sub", "iadd", "isub", "neg", "contiguous", "clone", "float", "to", "dropout"}


def _const(op_graph: OpGraph, value: object) -> object:
    """A node that computed a number (a size, a head count) stands for that number."""
    return op_graph.nodes[value.name].constant if isinstance(value, fx.Node) else value


def _meta(op_graph: OpGraph, node: fx.Node) -> TensorMeta | None:
    return op_graph.nodes[node.name].output


def _inputs(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def strategies(node: fx.Node, op_graph: OpGraph, t: int) -> list[Strategy]:
    """Every legal strategy of ``node`` on t ranks, the replicated one first."""
    inputs = _inputs(node)
    tensor = [_meta(op_graph, a) is not None or is_tuple_of_tensors(a, op_graph) for a in inputs]
    replicated = Strategy(
        output=REPLICATE, inputs=tuple(REPLICATE if is_t else None for is_t in tensor), divided=False
    )
    found = [replicated]
    rule = _RULES.get(op_name(node))
    if rule is not None and t > 1:
        for strategy in rule(node, op_graph, t, inputs):
            missing = len(inputs) - len(strategy.inputs)
            if missing:  # rules name the leading tensor inputs; the rest must be numbers
                if any(tensor[len(strategy.inputs):]):
                    continue
                strategy = Strategy(
                    output=strategy.output, inputs=strategy.inputs + (None,) * missing, divided=strategy.divided, kind=strategy.kind
                )
            if strategy not in found:
                found.append(strategy)
    return found


def is_tuple_of_tensors(node: fx.Node, op_graph: OpGraph) -> bool:
    return op_name(node) in ("split", "chunk") and op_graph.nodes[node.name].output is None


def _divisible(size: int, t: int, groups: int = 1) -> bool:
    return size % (t * groups) == 0 and size >= t * groups


def _follow(
    node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node], *, out_dims: list[int], groups: list[int] = (1,)
) -> list[Strategy]:
    """Output S(d) (or S(d,g)) for each allowed d, every tensor input sharded along its matching dim
    or, where it broadcasts along d, replicated."""
    out = _meta(op_graph, node)
    if out is None:
        return []
    found = []
    for d in out_dims:
        for g in groups:
            if not _divisible(out.shape[d], t, g) or (g > 1 and d != len(out.shape) - 1):
                continue
            required: list[Placement | None] = []
            for arg in inputs:
                meta = _meta(op_graph, arg)
                if meta is None:
                    required.append(None)
                    continue
                i = d - (len(out.shape) - len(meta.shape))
                required.append(REPLICATE if i < 0 or meta.shape[i] == 1 else shard(i, g))
            if all(p is None or p.kind != "S" or _divisible(_meta(op_graph, a).shape[p.dim], t, g) for a, p in zip(inputs, required)):
                found.append(Strategy(output=shard(d, g), inputs=tuple(required), divided=True))
    return found


def _elementwise(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    out = _meta(op_graph, node)
    if out is None:
        return []
    found = _follow(
        node, op_graph, t, inputs, out_dims=list(range(len(out.shape))), groups=_output_groups(node, op_graph)
    )
    name = op_name(node)
    tensors = [a for a in inputs if _meta(op_graph, a) is not None]
    if name in LINEAR_IN_PARTIAL and all(_meta(op_graph, a) is not None for a in inputs):
        scalars = [a for a in node.args[1:] if isinstance(a, (int, float))] if name in ("add", "sub") else []
        if not scalars:
            found.append(Strategy(output=PARTIAL, inputs=tuple(PARTIAL for _ in inputs), divided=True))
    if name in ("mul", "imul", "truediv") and tensors:
        numerators = tensors[:1] if name == "truediv" else tensors
        for partial in numerators:
            required = tuple(
                None if _meta(op_graph, a) is None else PARTIAL if a is partial else REPLICATE for a in inputs
            )
            found.append(Strategy(output=PARTIAL, inputs=required, divided=True))
    return found


def _reduction(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    """mean/sum/softmax/log_softmax over some dims: follow the input along the other dims."""
    source = _meta(op_graph, inputs[0]) if inputs else None
    out = _meta(op_graph, node)
    if source is None or out is None:
        return []
    rank = len(source.shape)
    dims = _const(op_graph, node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None))
    if dims is None:
        return []
    dims = {d % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    keep = op_name(node) in ("softmax", "log_softmax") or node.kwargs.get("keepdim", False)
    if not keep:
        return []  # dims would shift; rare in the models we shard
    return _follow(node, op_graph, t, inputs, out_dims=[d for d in range(rank) if d not in dims])


def _linear(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    out = _meta(op_graph, node)
    if out is None or not isinstance(x, fx.Node) or not isinstance(weight, fx.Node):
        return []
    last = len(out.shape) - 1

    def need(mapping: dict[fx.Node, Placement]) -> tuple[Placement | None, ...]:
        return tuple(mapping.get(a) for a in inputs)

    found = []
    for groups in _output_groups(node, op_graph):
        if _divisible(out.shape[-1], t, groups):
            mapping = {x: REPLICATE, weight: shard(0, groups)}
            if isinstance(bias, fx.Node):
                mapping[bias] = shard(0, groups)
            found.append(Strategy(output=shard(last, groups), inputs=need(mapping), divided=True))
    in_features = _meta(op_graph, weight).shape[1]
    if bias is None and _divisible(in_features, t):
        found.append(Strategy(output=PARTIAL, inputs=need({x: shard(last), weight: shard(1)}), divided=True))
    for d in range(last):  # split the rows of x: the weight replicated, its gradient partial
        if _divisible(out.shape[d], t):
            mapping = {x: shard(d), weight: REPLICATE}
            if isinstance(bias, fx.Node):
                mapping[bias] = REPLICATE
            found.append(Strategy(output=shard(d), inputs=need(mapping), divided=True))
    return found


def _output_groups(node: fx.Node, op_graph: OpGraph) -> list[int]:
    """1, and k when the output is split into k equal parts along its last dim soon after
    (directly, or through elementwise ops such as a bias add)."""
    groups = [1]
    out = _meta(op_graph, node)
    if out is None:
        return groups
    frontier, seen = list(node.users), set()
    while frontier:
        user = frontier.pop()
        if user in seen or len(seen) > 16:
            continue
        seen.add(user)
        name = op_name(user)
        if name in UNARY_ELEMENTWISE | BINARY_ELEMENTWISE and _meta(op_graph, user) == out:
            frontier.extend(user.users)
        size = _const(op_graph, user.args[1]) if len(user.args) > 1 else None
        if name == "chunk" and isinstance(size, int) and _last_dim(user, out, op_graph):
            groups.append(size)
        if name == "split" and isinstance(size, int) and _last_dim(user, out, op_graph):
            groups.append(out.shape[-1] // size)
    return sorted(set(groups))


def _last_dim(user: fx.Node, out: TensorMeta, op_graph: OpGraph) -> bool:
    dim = _const(op_graph, user.kwargs.get("dim", user.args[2] if len(user.args) > 2 else 0))
    return isinstance(dim, int) and dim % len(out.shape) == len(out.shape) - 1


def _split(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    source = _meta(op_graph, inputs[0])
    if source is None:
        return []
    rank = len(source.shape)
    dim = _const(op_graph, node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)) % rank
    size = _const(op_graph, node.args[1])
    parts = size if op_name(node) == "chunk" else source.shape[dim] // size if isinstance(size, int) else None
    found = []
    for d in range(rank):
        if d != dim and _divisible(source.shape[d], t):
            found.append(Strategy(output=shard(d), inputs=(shard(d),), divided=True))
    if isinstance(parts, int) and _divisible(source.shape[dim], t, parts):
        found.append(Strategy(output=shard(dim), inputs=(shard(dim, parts),), divided=True))
    return found


def _getitem(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    source = inputs[0] if inputs else None
    if source is None or not is_tuple_of_tensors(source, op_graph):
        return []
    meta = _meta(op_graph, node)
    found = [Strategy(output=shard(d), inputs=(shard(d),), divided=True) for d in range(len(meta.shape))]
    return found + [Strategy(output=PARTIAL, inputs=(PARTIAL,), divided=True)]


def _transpose(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    source, out = _meta(op_graph, inputs[0]), _meta(op_graph, node)
    if source is None or out is None:
        return []
    rank = len(source.shape)
    if op_name(node) == "transpose":
        a, b = (_const(op_graph, d) % rank for d in node.args[1:3])
        order = list(range(rank))
        order[a], order[b] = order[b], order[a]
    else:
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        order = [_const(op_graph, d) % rank for d in dims]
    found = [Strategy(output=PARTIAL, inputs=(PARTIAL,), divided=True)]
    for out_dim, in_dim in enumerate(order):
        if _divisible(source.shape[in_dim], t):
            found.append(Strategy(output=shard(out_dim), inputs=(shard(in_dim),), divided=True))
    return found


def _view(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    """A reshape carries S(d) to the outermost dim of the group of output dims that d becomes."""
    source, out = _meta(op_graph, inputs[0]), _meta(op_graph, node)
    if source is None or out is None:
        return []
    found = [Strategy(output=PARTIAL, inputs=(PARTIAL,) + (None,) * (len(inputs) - 1), divided=True)]
    for in_dims, out_dims in _reshape_groups(source.shape, out.shape):
        leading_in = next((d for d in in_dims if source.shape[d] != 1), None)
        leading_out = next((d for d in out_dims if out.shape[d] != 1), None)
        if leading_in is None or leading_out is None:
            continue
        if _divisible(source.shape[leading_in], t) and _divisible(out.shape[leading_out], t):
            required = (shard(leading_in),) + (None,) * (len(inputs) - 1)
            found.append(Strategy(output=shard(leading_out), inputs=required, divided=True))
    return found


def _reshape_groups(source: tuple[int, ...], out: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    groups, i, j = [], 0, 0
    while i < len(source) and j < len(out):
        in_dims, out_dims = [i], [j]
        a, b = source[i], out[j]
        while a != b:
            if a < b:
                i += 1
                a *= source[i]
                in_dims.append(i)
            else:
                j += 1
                b *= out[j]
                out_dims.append(j)
        groups.append((in_dims, out_dims))
        i, j = i + 1, j + 1
    return groups


def _embedding(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    ids, weight = node.args[0], node.args[1]
    vocab, hidden = _meta(op_graph, weight).shape
    out = _meta(op_graph, node)
    mapping = lambda m: tuple(m.get(a) for a in inputs)  # noqa: E731
    found = []
    if _divisible(vocab, t) and node.kwargs.get("padding_idx") is None and node.kwargs.get("max_norm") is None:
        found.append(
            Strategy(
                output=PARTIAL,
                inputs=mapping({ids: REPLICATE, weight: shard(0)}),
                divided=True,
                kind="vocab_parallel_embedding",
            )
        )
    if _divisible(hidden, t):
        found.append(Strategy(output=shard(len(out.shape) - 1), inputs=mapping({ids: REPLICATE, weight: shard(1)}), divided=True))
    return found


def _cross_entropy(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    logits, target = node.args[0], node.args[1]
    meta = _meta(op_graph, logits)
    plain = (
        node.kwargs.get("weight") is None
        and node.kwargs.get("reduction", "mean") == "mean"
        and not node.kwargs.get("label_smoothing", 0.0)
        and len(node.args) == 2
    )
    if meta is None or len(meta.shape) != 2 or not plain or not _divisible(meta.shape[1], t):
        return []
    required = tuple({logits: shard(1), target: REPLICATE}.get(a) for a in inputs)
    return [Strategy(output=REPLICATE, inputs=required, divided=True, kind="vocab_parallel_cross_entropy")]


def _attention(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    if node.kwargs.get("attn_mask") is not None or len(node.args) > 3:
        return []
    return _follow(node, op_graph, t, inputs, out_dims=[0, 1])


def _layer_norm(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    out = _meta(op_graph, node)
    normalized = len(node.args[1]) if len(node.args) > 1 else len(node.kwargs["normalized_shape"])
    return _follow(node, op_graph, t, inputs, out_dims=list(range(len(out.shape) - normalized)))


def _repeat_interleave(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    out = _meta(op_graph, node)
    if out is None or len(inputs) != 1:
        return []
    return _follow(node, op_graph, t, inputs, out_dims=list(range(len(out.shape))))


def _cat(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    out = _meta(op_graph, node)
    dim = _const(op_graph, node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)) % len(out.shape)
    return _follow(node, op_graph, t, inputs, out_dims=[d for d in range(len(out.shape)) if d != dim])


_RULES: dict[str, Callable[[fx.Node, OpGraph, int, list[fx.Node]], list[Strategy]]] = {
    **{name: _elementwise for name in UNARY_ELEMENTWISE | BINARY_ELEMENTWISE},
    "mean": _reduction,
    "sum": _reduction,
    "softmax": _reduction,
    "log_softmax": _reduction,
    "linear": _linear,
    "split": _split,
    "chunk": _split,
    "getitem": _getitem,
    "transpose": _transpose,
    "permute": _transpose,
    "view": _view,
    "reshape": _view,
    "embedding": _embedding,
    "cross_entropy": _cross_entropy,
    "scaled_dot_product_attention": _attention,
    "layer_norm": _layer_norm,
    "repeat_interleave": _repeat_interleave,
    "cat": _cat,
}
