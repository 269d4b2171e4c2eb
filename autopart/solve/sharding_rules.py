"""The tensor-parallel strategies of each op: ``strategies(node, op_graph, t)``.

Every op has the replicated strategy (all R, the whole op on every rank), so what cannot be
split stays replicated and is never silently wrong. The others follow DTensor's and
Megatron-LM's rules: column- and row-parallel linear (``F.linear`` and the ``mm`` that a
Conv1D exports to), vocabulary- and hidden-parallel embedding, vocabulary-parallel
cross-entropy, ops that follow their inputs along dims they do not reduce over, and views,
transposes, splits, unsqueezes and expands that carry a sharded dim through a reshape. Each rule
reads its arguments through ``argument`` so that it serves fx and torch.export graphs alike.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import fx

from autopart.passes.annotate import OpGraph
from autopart.solve.sharding import (
    BINARY_ELEMENTWISE,
    PARTIAL,
    REPLICATE,
    UNARY_ELEMENTWISE,
    Placement,
    Strategy,
    argument,
    constant_of,
    divisible,
    follow,
    is_aten,
    is_tuple_of_tensors,
    meta_of,
    op_name,
    output_groups,
    shard,
)

__all__ = ["strategies"]

LINEAR_IN_PARTIAL = {"add", "sub", "iadd", "isub", "neg", "contiguous", "clone", "float", "to", "dropout", "alias"}


def strategies(node: fx.Node, op_graph: OpGraph, t: int) -> list[Strategy]:
    """Every legal strategy of ``node`` on t ranks, the replicated one first."""
    inputs = list(node.all_input_nodes)
    tensor = [meta_of(op_graph, a) is not None or is_tuple_of_tensors(a, op_graph) for a in inputs]
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


def _elementwise(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    out = meta_of(op_graph, node)
    if out is None:
        return []
    found = follow(node, op_graph, t, inputs, out_dims=list(range(len(out.shape))), groups=output_groups(node, op_graph))
    name = op_name(node)
    tensors = [a for a in inputs if meta_of(op_graph, a) is not None]
    if name in LINEAR_IN_PARTIAL and all(meta_of(op_graph, a) is not None for a in inputs):
        scalars = [a for a in node.args[1:] if isinstance(a, (int, float))] if name in ("add", "sub") else []
        if not scalars:
            found.append(Strategy(output=PARTIAL, inputs=tuple(PARTIAL for _ in inputs), divided=True))
    if name in ("mul", "imul", "truediv") and tensors:
        numerators = tensors[:1] if name == "truediv" else tensors
        for partial in numerators:
            required = tuple(
                None if meta_of(op_graph, a) is None else PARTIAL if a is partial else REPLICATE for a in inputs
            )
            found.append(Strategy(output=PARTIAL, inputs=required, divided=True))
    return found


def _type_as(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    """``b.type_as(y)`` (a separated bias in its product's dtype) reads only y's dtype: y may be
    placed anyhow, b's placement carries through, in the groups of y's last dim (a fused QKV's)."""
    out = meta_of(op_graph, node)
    source, other = node.args[0], node.args[1]
    if out is None or not isinstance(source, fx.Node) or not isinstance(other, fx.Node) or source is other:
        return []
    found = follow(node, op_graph, t, [source], out_dims=list(range(len(out.shape))), groups=output_groups(other, op_graph))
    found += [Strategy(output=p, inputs=(p,), divided=p.kind != "R") for p in (REPLICATE, PARTIAL)]
    return [Strategy(output=s.output, inputs=tuple(s.inputs[0] if a is source else None for a in inputs),
                     divided=s.divided) for s in found]  # fmt: skip


def _reduction(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    """mean/sum/softmax/log_softmax over some dims: follow the input along the other dims."""
    source = meta_of(op_graph, inputs[0]) if inputs else None
    out = meta_of(op_graph, node)
    if source is None or out is None:
        return []
    rank = len(source.shape)
    dims = constant_of(op_graph, argument(node, 1, "dim"))
    if dims is None:
        return []
    dims = {d % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    keep = op_name(node) in ("softmax", "log_softmax") or argument(node, 2, "keepdim", False) is True
    if not keep:
        return []  # dims would shift; rare in the models we shard
    return follow(node, op_graph, t, inputs, out_dims=[d for d in range(rank) if d not in dims])


def _linear(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    """``F.linear(x, w, b)``, w of (out, in); and ``aten.mm(x, w)``, w of (in, out) as a Conv1D
    holds it: column-parallel (w split along out), row-parallel (along in: partial sums), or the
    rows of x split with w whole."""
    x, weight = node.args[0], node.args[1]
    linear = op_name(node) == "linear"
    bias = argument(node, 2, "bias") if linear else None
    out = meta_of(op_graph, node)
    if out is None or not isinstance(x, fx.Node) or not isinstance(weight, fx.Node) or meta_of(op_graph, weight) is None:
        return []
    out_dim, in_dim = (0, 1) if linear else (1, 0)
    last = len(out.shape) - 1

    def need(mapping: dict[fx.Node, Placement]) -> tuple[Placement | None, ...]:
        return tuple(mapping.get(a) for a in inputs)

    found = []
    for groups in output_groups(node, op_graph):
        if divisible(out.shape[-1], t, groups):
            mapping = {x: REPLICATE, weight: shard(out_dim, groups)}
            if isinstance(bias, fx.Node):
                mapping[bias] = shard(0, groups)
            found.append(Strategy(output=shard(last, groups), inputs=need(mapping), divided=True))
    in_features = meta_of(op_graph, weight).shape[in_dim]
    if bias is None and divisible(in_features, t):
        found.append(Strategy(output=PARTIAL, inputs=need({x: shard(last), weight: shard(in_dim)}), divided=True))
    for d in range(last):  # split the rows of x: the weight replicated, its gradient partial
        if divisible(out.shape[d], t):
            mapping = {x: shard(d), weight: REPLICATE}
            if isinstance(bias, fx.Node):
                mapping[bias] = REPLICATE
            found.append(Strategy(output=shard(d), inputs=need(mapping), divided=True))
    return found


def _split(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    source = meta_of(op_graph, inputs[0])
    if source is None:
        return []
    rank = len(source.shape)
    dim = constant_of(op_graph, argument(node, 2, "dim", 0)) % rank
    size = constant_of(op_graph, node.args[1])
    parts = size if op_name(node) == "chunk" else source.shape[dim] // size if isinstance(size, int) else None
    found = []
    for d in range(rank):
        if d != dim and divisible(source.shape[d], t):
            found.append(Strategy(output=shard(d), inputs=(shard(d),), divided=True))
    if isinstance(parts, int) and divisible(source.shape[dim], t, parts):
        found.append(Strategy(output=shard(dim), inputs=(shard(dim, parts),), divided=True))
    return found


def _getitem(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    source = inputs[0] if inputs else None
    if source is None or not is_tuple_of_tensors(source, op_graph):
        return []
    meta = meta_of(op_graph, node)
    found = [Strategy(output=shard(d), inputs=(shard(d),), divided=True) for d in range(len(meta.shape))]
    return found + [Strategy(output=PARTIAL, inputs=(PARTIAL,), divided=True)]


def _transpose(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    source, out = meta_of(op_graph, inputs[0]), meta_of(op_graph, node)
    if source is None or out is None:
        return []
    rank = len(source.shape)
    name = op_name(node)
    if name == "t":
        order = list(range(rank))[::-1]
    elif name == "transpose":
        a, b = (constant_of(op_graph, d) % rank for d in node.args[1:3])
        order = list(range(rank))
        order[a], order[b] = order[b], order[a]
    else:
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        order = [constant_of(op_graph, d) % rank for d in dims]
    found = [Strategy(output=PARTIAL, inputs=(PARTIAL,), divided=True)]
    for out_dim, in_dim in enumerate(order):
        if divisible(source.shape[in_dim], t):
            found.append(Strategy(output=shard(out_dim), inputs=(shard(in_dim),), divided=True))
    return found


def _view(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    """A reshape carries S(d) to the outermost dim of the group of output dims that d becomes; a
    last dim kept whole carries the groups of a fused output (S(1,3) of (B·T, 3h) to S(2,3))."""
    source, out = meta_of(op_graph, inputs[0]), meta_of(op_graph, node)
    if source is None or out is None:
        return []
    rest = (None,) * (len(inputs) - 1)
    found = [Strategy(output=PARTIAL, inputs=(PARTIAL,) + rest, divided=True)]
    for in_dims, out_dims in _reshape_groups(source.shape, out.shape):
        leading_in = next((d for d in in_dims if source.shape[d] != 1), None)
        leading_out = next((d for d in out_dims if out.shape[d] != 1), None)
        if leading_in is None or leading_out is None:
            continue
        if divisible(source.shape[leading_in], t) and divisible(out.shape[leading_out], t):
            found.append(Strategy(output=shard(leading_out), inputs=(shard(leading_in),) + rest, divided=True))
    last_kept = len(source.shape) > 0 and len(out.shape) > 0 and source.shape[-1] == out.shape[-1]
    for g in output_groups(node, op_graph)[1:] if last_kept else ():
        if divisible(out.shape[-1], t, g):
            in_last, out_last = len(source.shape) - 1, len(out.shape) - 1
            found.append(Strategy(output=shard(out_last, g), inputs=(shard(in_last, g),) + rest, divided=True))
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


def _unsqueeze(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    source, out = meta_of(op_graph, inputs[0]), meta_of(op_graph, node)
    if source is None or out is None:
        return []
    new = constant_of(op_graph, argument(node, 1, "dim")) % len(out.shape)
    found = [Strategy(output=PARTIAL, inputs=(PARTIAL,), divided=True)]
    for d in range(len(source.shape)):
        if divisible(source.shape[d], t):
            found.append(Strategy(output=shard(d + (d >= new)), inputs=(shard(d),), divided=True))
    return found


def _expand(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    """Follows the input along the dims it does not broadcast (GQA's repeated key-value heads)."""
    source, out = meta_of(op_graph, inputs[0]), meta_of(op_graph, node)
    if source is None or out is None:
        return []
    offset = len(out.shape) - len(source.shape)
    kept = [d for d in range(offset, len(out.shape)) if source.shape[d - offset] == out.shape[d] != 1]
    return follow(node, op_graph, t, inputs[:1], out_dims=kept)


def _slice(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    out = meta_of(op_graph, node)
    if out is None:
        return []
    dim = constant_of(op_graph, argument(node, 1, "dim", 0)) % len(out.shape)
    return follow(node, op_graph, t, inputs[:1], out_dims=[d for d in range(len(out.shape)) if d != dim])


def _embedding(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    aten = is_aten(node)  # aten.embedding(weight, ids, padding_idx=-1); F.embedding(ids, weight, padding_idx=None)
    weight, ids = (node.args[0], node.args[1]) if aten else (node.args[1], node.args[0])
    vocab, hidden = meta_of(op_graph, weight).shape
    out = meta_of(op_graph, node)
    padding = argument(node, 2, "padding_idx", -1 if aten else None)
    mapping = lambda m: tuple(m.get(a) for a in inputs)  # noqa: E731
    found = []
    if divisible(vocab, t) and padding in (None, -1) and node.kwargs.get("max_norm") is None:
        found.append(
            Strategy(
                output=PARTIAL,
                inputs=mapping({ids: REPLICATE, weight: shard(0)}),
                divided=True,
                kind="vocab_parallel_embedding",
            )
        )
    if divisible(hidden, t):
        found.append(Strategy(output=shard(len(out.shape) - 1), inputs=mapping({ids: REPLICATE, weight: shard(1)}), divided=True))
    return found


def _cross_entropy(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    logits, target = node.args[0], node.args[1]
    meta = meta_of(op_graph, logits)
    if is_aten(node):  # aten.cross_entropy_loss(logits, target, weight, reduction=1 (mean), ignore_index, smoothing)
        plain = argument(node, 2, "weight") is None and argument(node, 3, "reduction", 1) == 1 and not argument(node, 5, "label_smoothing", 0.0)
    else:
        plain = (
            node.kwargs.get("weight") is None
            and node.kwargs.get("reduction", "mean") == "mean"
            and not node.kwargs.get("label_smoothing", 0.0)
            and len(node.args) == 2
        )
    if meta is None or len(meta.shape) != 2 or not plain or not divisible(meta.shape[1], t):
        return []
    required = tuple({logits: shard(1), target: REPLICATE}.get(a) for a in inputs)
    return [Strategy(output=REPLICATE, inputs=required, divided=True, kind="vocab_parallel_cross_entropy")]


def _attention(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    """Split over the batch or the heads, never the sequence (the keys each query sees); a mask
    follows along the dims it does not broadcast. With
    dropout on the probabilities each rank draws its slice's from a stream of its own
    (``tp.sharded_attention``, emitted by `autopart.codegen.tensor_parallel`)."""
    out = meta_of(op_graph, node)  # (batch, heads, sequence, head dim), or (batch·heads, sequence, head dim)
    return follow(node, op_graph, t, inputs, out_dims=list(range(len(out.shape) - 2)))


def _layer_norm(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    out = meta_of(op_graph, node)
    normalized = len(argument(node, 1, "normalized_shape"))
    return follow(node, op_graph, t, inputs, out_dims=list(range(len(out.shape) - normalized)))


def _repeat_interleave(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    out = meta_of(op_graph, node)
    if out is None or len(inputs) != 1:
        return []
    return follow(node, op_graph, t, inputs, out_dims=list(range(len(out.shape))))


def _cat(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    out = meta_of(op_graph, node)
    dim = constant_of(op_graph, argument(node, 1, "dim", 0)) % len(out.shape)
    return follow(node, op_graph, t, inputs, out_dims=[d for d in range(len(out.shape)) if d != dim])


_RULES: dict[str, Callable[[fx.Node, OpGraph, int, list[fx.Node]], list[Strategy]]] = {
    **{name: _elementwise for name in UNARY_ELEMENTWISE | BINARY_ELEMENTWISE},
    "type_as": _type_as,
    "mean": _reduction,
    "sum": _reduction,
    "softmax": _reduction,
    "log_softmax": _reduction,
    "linear": _linear,
    "mm": _linear,
    "split": _split,
    "chunk": _split,
    "getitem": _getitem,
    "transpose": _transpose,
    "permute": _transpose,
    "t": _transpose,
    "view": _view,
    "reshape": _view,
    "unsqueeze": _unsqueeze,
    "expand": _expand,
    "slice": _slice,
    "embedding": _embedding,
    "cross_entropy": _cross_entropy,
    "scaled_dot_product_attention": _attention,
    "layer_norm": _layer_norm,
    "repeat_interleave": _repeat_interleave,
    "cat": _cat,
}


def _matmul(node: fx.Node, op_graph: OpGraph, t: int, inputs: list[fx.Node]) -> list[Strategy]:
    """``a @ b`` of (..., n, k) and (..., k, m): follow both along the leading (batch, head) dims;
    attention written out (scores, then the values) splits over the heads as SDPA does."""
    out = meta_of(op_graph, node)
    if out is None or len(inputs) != 2 or any(meta_of(op_graph, a) is None for a in inputs):
        return []
    return follow(node, op_graph, t, inputs, out_dims=list(range(len(out.shape) - 2)))


_RULES["matmul"] = _matmul
