"""Rewrite a stage graph for tensor parallelism: local shapes, explicit collectives, sharded ops.

``shard_stage_graph(stage, strategies=..., parameters=..., op_graph=..., tp=t)`` takes the stage
graph of ``autopart.codegen.stages`` and the solver's choices and returns the graph that one TP
rank runs:

- where a tensor's placement differs from what its consumer needs, the conversion is inserted
  (``tp.all_reduce``, ``tp.all_gather``, ``tp.scatter``, and with sequence parallelism
  ``tp.reduce_scatter``; what the stage receives and sends is as the plan holds it across the
  boundary, the residual stream's slice under sequence parallelism); a replicated tensor that
  needs a gradient and feeds a split op goes through ``tp.copy_to_tp`` (all-reduce of its
  gradient; a weight's through ``tp.copy_weight_to_tp``, summed in fp32), or, gathered from a sequence split, through ``tp.gather_from_sequence`` (its gradient
  reduce-scattered); under autocast, of an activation that only matrix products read, each moves
  the dtype they read
  (``tp.copy_for_products``, ``tp.gather_for_products``);
- with ``overlap`` (``--tp-overlap``), a gathered linear and a row-parallel linear whose output
  is reduce-scattered run in pieces, each collective beside the products
  (``autopart.runtime.overlapped``; which linears, ``autopart.solve.overlap``);
- vocabulary-parallel embedding and cross-entropy become their ``tp.`` functions, and a dropout
  of a split tensor ``tp.sharded_dropout`` (``tp.sharded_attention`` for attention's): each rank's
  slice drawn from a stream of its own;
- the shapes in views, reshapes and splits become the local ones (the code shows local head
  counts), and other numbers computed from activation sizes become the constants they are.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import fx
from torch.nn import functional as F

from autopart.ir.tensors import TensorMeta, autocast_dtype
from autopart.passes.annotate import OpGraph
from autopart.codegen.stages import StageGraph, kept_unread
from autopart.ir.errors import PlanError
from autopart.runtime import collectives
from autopart.runtime import overlapped as overlapped_linears
from autopart.solve.sharding import (
    REPLICATE, Placement, Strategy, argument, constant_of, folded_number, is_aten, local_shape, op_name,
)
from autopart.solve.overlap import moves_for_products
from autopart.solve.tensor import conversion, gathers_for_split_op

__all__ = ["overlapped_shapes", "shard_stage_graph"]

_DRAWING = {  # an op that draws, and what a split tensor's rank calls instead
    F.dropout: collectives.sharded_dropout,
    torch.dropout: collectives.sharded_dropout,  # (input, p, train): F.dropout's first three
    F.scaled_dot_product_attention: collectives.sharded_attention,
}
_KINDS = {
    "vocab_parallel_embedding": collectives.vocab_parallel_embedding,
    "vocab_parallel_cross_entropy": collectives.vocab_parallel_cross_entropy,
}


def shard_stage_graph(
    stage: StageGraph,
    *,
    strategies: dict[str, Strategy],
    parameters: dict[str, Placement],
    op_graph: OpGraph,
    tp: int,
    overlapped: dict[str, int] | None = None,
    boundary: dict[str, Placement] | None = None,
) -> StageGraph:
    """``boundary``: the values received or sent that the ranks hold split (the residual stream
    under sequence parallelism, each rank's slice of the sequence), by name; the others cross whole."""
    graph = stage.graph
    boundary = boundary or {}
    placement: dict[str, Placement] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            placement[node.name] = parameters.get(str(node.target), REPLICATE)
        elif node.name in strategies:
            placement[node.name] = strategies[node.name].output
        elif node.op == "placeholder" and node.name in boundary:
            placement[node.name] = boundary[node.name]
    convert = _Conversions(graph, placement)

    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        strategy = strategies.get(node.name)
        if strategy is not None:
            swap = {}
            for arg, required in zip(node.all_input_nodes, strategy.inputs):
                if required is None:
                    continue
                copy = strategy.copies(required, arg.name in op_graph.nodes and op_graph.nodes[arg.name].needs_grad)
                if placement.get(arg.name, REPLICATE) != required or copy:
                    swap[arg] = convert(arg, required, copy, node)
            if swap:
                node.args = fx.map_arg(node.args, lambda a: swap.get(a, a))
                node.kwargs = fx.map_arg(node.kwargs, lambda a: swap.get(a, a))
            if strategy.kind:
                _replace_op(node, strategy.kind)
            elif strategy.output.kind == "S" and node.target in _DRAWING:
                if node.target in (F.dropout, torch.dropout) or argument(node, 4, "dropout_p", 0.0):
                    if "train" in node.kwargs:  # torch.dropout's name of F.dropout's ``training``
                        node.kwargs = {("training" if k == "train" else k): v for k, v in node.kwargs.items()}
                    node.target = _DRAWING[node.target]  # each rank's slice its own mask
        _fold_numbers(node, op_graph, placement, tp)
    for node in graph.nodes:  # the outputs: sent on as the plan holds them (whole, or a slice), or the (replicated) loss
        if node.op == "output":
            node.args = fx.map_arg(node.args, lambda a: convert(a, boundary.get(a.name, REPLICATE), False, node))
    graph.eliminate_dead_code(is_impure_node=kept_unread)
    _fuse_gathered_linears(graph)
    if autocast_dtype(op_graph.dtype) is not None:
        _move_for_products(graph, op_graph, convert.sources)
    if overlapped:
        _overlap_linears(graph, overlapped, op_graph, tp)
    graph.lint()
    return replace(stage, graph=graph)


class _Conversions:
    """Inserts the collectives that turn a value's placement into what a reader needs: one per
    (value, placement, copied), shared by the readers that need it so, as the solver prices it."""

    def __init__(self, graph: fx.Graph, placement: dict[str, Placement]):
        self.graph, self.placement = graph, placement
        self.converted: dict[tuple[str, Placement, bool], fx.Node] = {}
        self.sources: dict[fx.Node, str] = {}  # a gather_from_sequence or copy_to_tp -> the value it moves

    def __call__(self, arg: fx.Node, required: Placement, copy: bool, before: fx.Node) -> fx.Node:
        key = (arg.name, required, copy)
        if key in self.converted:
            return self.converted[key]
        current, value = self.placement.get(arg.name, REPLICATE), arg
        if conversion(current, required, sequence_parallel=True) is None:
            # a value that two blocks' layouts meet at, which no one collective turns from the one
            # into the other (logits split over the sequence, a loss that wants the vocabulary
            # split): the solver priced it through the block boundary, replicated there
            # (``autopart.solve.sequence.boundary_placement``), and so it goes
            value, current = self(arg, REPLICATE, False, before), REPLICATE
        step = conversion(current, required, sequence_parallel=True)  # the plan chose; any legal step is emitted
        assert step is not None, f"{arg.name}: {current} cannot become {required}"
        call = self.graph.call_function
        with self.graph.inserting_before(before):
            if gathers_for_split_op(current, required, copy):
                value = call(collectives.gather_from_sequence, (value, current.dim))
                self.sources[value] = arg.name
                copy = False  # its backward already sums the partial gradients
            elif current.kind == "P" and required.kind == "S":
                value = call(collectives.reduce_scatter, (value, required.dim))
            elif current.kind == "P":
                value = call(collectives.all_reduce, (value,))
            elif current.kind == "S" and required == REPLICATE:
                value = call(collectives.all_gather, (value, current.dim, current.groups))
            elif current == REPLICATE and required.kind == "S":
                value = call(collectives.scatter, (value, required.dim, required.groups))
            if copy:  # a weight's gradient summed in fp32 (`tp.copy_weight_to_tp`), an activation's in its dtype
                weight = arg.op == "get_attr"
                value = call(collectives.copy_weight_to_tp if weight else collectives.copy_to_tp, (value,))
                self.sources[value] = arg.name
        self.converted[key] = value
        return value


def _fuse_gathered_linears(graph: fx.Graph) -> None:
    """A linear that alone reads a ``gather_from_sequence`` becomes ``tp.gathered_linear`` of the
    slice, which gathers again in backward instead of keeping the whole input (Megatron-SP)."""
    for gather in list(graph.nodes):
        if gather.target is not collectives.gather_from_sequence or len(gather.users) != 1:
            continue
        linear = next(iter(gather.users))
        if op_name(linear) != "linear" or is_aten(linear) or not linear.args or linear.args[0] is not gather:
            continue
        weight = linear.args[1] if len(linear.args) > 1 else linear.kwargs.get("weight")
        if gather in (weight, argument(linear, 2, "bias")):
            continue
        shard, dim = gather.args
        linear.target, linear.op = collectives.gathered_linear, "call_function"
        linear.args, linear.kwargs = (shard, weight, argument(linear, 2, "bias"), dim), {}
        graph.erase_node(gather)


_FOR_PRODUCTS = {
    collectives.gather_from_sequence: collectives.gather_for_products,
    collectives.copy_to_tp: collectives.copy_for_products,
}


def _move_for_products(graph: fx.Graph, op_graph: OpGraph, sources: dict[fx.Node, str]) -> None:
    """Under autocast, a ``gather_from_sequence`` or ``copy_to_tp`` of an activation that only
    matrix products read (a Llama layer's normed input of q, k and v) becomes its ``_for_products``
    form, which moves the dtype they read, by the rule the solver prices it by
    (``autopart.solve.overlap.moves_for_products``, which the solver asks of every reader that
    may need the conversion). A weight's gradient is summed in fp32 (`tp.copy_weight_to_tp`)."""
    for node in list(graph.nodes):
        source = sources.get(node)  # None: not inserted by this pass, left as it is
        if node.target in _FOR_PRODUCTS and source is not None and moves_for_products(op_graph, source, node.users):
            with graph.inserting_after(node):  # a new node, named for what it calls
                moved = graph.call_function(_FOR_PRODUCTS[node.target], node.args)
            node.replace_all_uses_with(moved)
            graph.erase_node(node)


def _overlap_linears(graph: fx.Graph, overlapped: dict[str, int], op_graph: OpGraph, tp: int) -> None:
    """The linears the plan cuts into pieces (``overlapped``: linear -> pieces) become their
    overlapped forms: a gathered linear, or a row-parallel one (no bias) read only by a
    reduce-scatter, which the linear's node absorbs (it keeps its name: the op the plan placed).
    ``autopart.solve.overlap`` chose them and priced the same; a name the plan gives that is not
    such a linear of this stage is refused (a plan edited by hand)."""
    cut = set()
    for node in list(graph.nodes):
        if node.target is collectives.gathered_linear and node.name in overlapped:
            shard, weight, bias, dim = node.args
            pieces = _pieces(overlapped, node.name, shard.name, dim, op_graph, tp)
            node.target, node.args = overlapped_linears.gathered_linear, (shard, weight, bias, dim, pieces)
            cut.add(node.name)
        elif node.target is collectives.reduce_scatter and getattr(node.args[0], "name", None) in overlapped:
            linear, dim = node.args
            if op_name(linear) != "linear" or is_aten(linear) or len(linear.users) != 1 or argument(linear, 2, "bias") is not None:
                raise PlanError(f"the plan overlaps {linear.name}, which is not a linear read only by its reduce-scatter")
            pieces = _pieces(overlapped, linear.name, linear.name, dim, op_graph, tp)
            x, weight = argument(linear, 0, "input"), argument(linear, 1, "weight")
            linear.target, linear.op, linear.kwargs = overlapped_linears.linear_reduce_scatter, "call_function", {}
            linear.args = (x, weight, dim, pieces)
            node.replace_all_uses_with(linear)
            graph.erase_node(node)
            cut.add(linear.name)
    left = sorted(set(overlapped) - cut)
    if left:
        raise PlanError(f"the plan cuts {left[0]} into pieces, but this stage has no such gathered or reduce-scattered "
                        "linear; recompile, or drop it from the stage's \"overlapped\"")


def _pieces(overlapped: dict[str, int], linear: str, value: str, dim: int, op_graph: OpGraph, tp: int) -> int:
    """The plan's pieces for ``linear``, which must cut each rank's slice of ``value`` evenly."""
    pieces = overlapped[linear]
    rows = op_graph.nodes[value].output.shape[dim] // tp
    if rows % pieces:
        raise PlanError(f"the plan cuts {linear} into {pieces} pieces, which do not divide a rank's {rows} rows")
    return pieces


def overlapped_shapes(stage: StageGraph, shapes: dict[str, tuple], tp: int) -> dict[str, tuple]:
    """``shapes`` (per tensor, what one rank holds) with a linear fused with its reduce-scatter
    holding its slice of the sequence, not the whole partial product."""
    shapes = dict(shapes)
    for node in stage.graph.nodes:
        if node.target is overlapped_linears.linear_reduce_scatter and node.name in shapes:
            (shape, dtype), dim = shapes[node.name], node.args[2]
            shapes[node.name] = ((*shape[:dim], shape[dim] // tp, *shape[dim + 1:]), dtype)
    return shapes


def _replace_op(node: fx.Node, kind: str) -> None:
    aten = is_aten(node)
    if kind == "vocab_parallel_embedding":  # aten.embedding takes (weight, ids), F.embedding (ids, weight)
        ids, weight = (node.args[1], node.args[0]) if aten else node.args[:2]
        node.target, node.args, node.kwargs = _KINDS[kind], (ids, weight), {}
    elif kind == "vocab_parallel_cross_entropy":
        ignore = argument(node, 4, "ignore_index", -100)  # fifth in F.cross_entropy and in ATen's
        node.target, node.args, node.kwargs = _KINDS[kind], node.args[:2], {"ignore_index": ignore}
    node.op = "call_function"


_SHAPED = {"view", "reshape", "expand"}
"""Ops that take the shape of their output: the local one where the output is sharded."""


def _fold_numbers(node: fx.Node, op_graph: OpGraph, placement: dict[str, Placement], tp: int) -> None:
    """Sizes become constants: local ones where they shape a sharded tensor, global ones elsewhere."""
    cost = op_graph.nodes.get(node.name)
    name = op_name(node)
    out = placement.get(node.name, REPLICATE)
    if cost is not None and cost.output is not None and name in _SHAPED:
        shape = local_shape(cost.output.shape, out, tp)
        if node.op == "call_method":  # x.view(B, T, nh, hs)
            node.args = (node.args[0], *shape)
            return
        if is_aten(node):  # aten.view.default(x, [B, T, nh, hs])
            node.args = (node.args[0], list(shape), *node.args[2:])
            return
    if name == "split" and (node.op == "call_method" or is_aten(node)):
        source = placement.get(node.args[0].name, REPLICATE)
        size = constant_of(op_graph, node.args[1])
        dim = constant_of(op_graph, argument(node, 2, "dim", 0))
        rank = len(_source_meta(node.args[0], op_graph).shape)
        if source.kind == "S" and source.dim == dim % rank and isinstance(size, int):
            size //= tp
        node.args = (node.args[0], size, *node.args[2:])
    node.args = fx.map_arg(node.args, lambda a: _constant_or_node(a, op_graph))
    node.kwargs = fx.map_arg(node.kwargs, lambda a: _constant_or_node(a, op_graph))


def _source_meta(value: fx.Node, op_graph: OpGraph) -> TensorMeta:
    """The metadata of the tensor ``value`` carries: a collective inserted here keeps its input's."""
    while value.name not in op_graph.nodes:
        value = value.args[0]
    return op_graph.nodes[value.name].output


def _constant_or_node(arg: fx.Node, op_graph: OpGraph):
    return op_graph.nodes[arg.name].constant if folded_number(op_graph, arg) else arg
