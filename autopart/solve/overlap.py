"""What the sequence-parallel linears' collectives cost once they overlap their products.

Two patterns of a sequence-parallel block are fused by the generated code
(``autopart.codegen.tensor_parallel``):

- a column-parallel linear that alone reads an input gathered from the sequence runs as
  ``tp.gathered_linear``: the gather in forward, and in backward the input's gradient
  reduce-scattered and the slice gathered again for the weight's gradient (Megatron-SP keeps
  the slice, not the gathered input);
- with ``--tp-overlap``, a row-parallel linear (no bias) whose output goes only to a
  reduce-scatter into the sequence split runs as ``overlapped.linear_reduce_scatter``, and the
  gathered linear as ``overlapped.gathered_linear`` (``autopart.runtime.overlapped``).

Overlapped, the linear's products and its collectives' pieces run on two streams, each piece
waiting only for what it reads (``exposed_s``): a gathered linear multiplies its own rows while
the first piece is gathered, a scattered one reduce-scatters each piece while the next
multiplies, so about one piece of the collectives stays exposed where the products take longer
than the collectives, and what the collectives take beyond the products where they do not. It
rests on the collectives running beside the products at their full rate, on a stream of their
own: where they take some of the cores the products run on (a few of an accelerator's, all of a
host's when its threads run them), the overlap is less than this counts.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from torch import fx

from autopart.ir.tensors import autocast_dtype
from autopart.passes.annotate import OpGraph
from autopart.solve.sharding import (
    REPLICATE, Placement, Strategy, argument, folded_number, is_aten, is_tuple_of_tensors, op_name,
)
from cost_models import CostModel

__all__ = ["FusedLinear", "Products", "exposed_s", "fused_linears", "fused_seconds", "gathered_input", "linear_products",
           "moved_share", "moves_for_products", "piece_counts", "products_only", "reads_the_batch"]


@dataclass(frozen=True)
class FusedLinear:
    kind: str  # "gathered": its input gathered from the sequence; "scattered": its output reduce-scattered
    linear: str  # the linear's node
    input: str  # the linear's input
    value: str  # the tensor the collective moves: the gathered input, or the linear's output
    dim: int  # the sequence dimension it is split along


Products = Callable[[str, float], float]
"""Seconds of the linear's ``"forward"``, ``"input"`` or ``"weight"`` gradient product on a
fraction of the rows one rank multiplies (1: all of them)."""


def exposed_s(kind: str, *, pieces: int, t: int, products: Products, gather_s: float, scatter_s: float,
              input_gradient: bool = True) -> tuple[float, float]:
    """Forward and backward seconds that a fused linear in ``pieces`` adds to its whole products,
    run as ``autopart.runtime.overlapped`` orders it: its products in program order on the
    compute stream, its collectives in the order it starts them on their own stream, each
    waiting only for what it reads. ``gather_s``/``scatter_s``: one piece's all-gather and
    reduce-scatter. Smaller products run at a lower rate (``products``), which counts too."""
    k, rest = pieces, (t - 1) / (t * pieces)
    forward = products("forward", 1.0)
    weight = products("weight", 1.0)
    input_piece = (lambda fraction: products("input", fraction)) if input_gradient else (lambda fraction: 0.0)
    if kind == "gathered":
        ahead = _end_s([(products("forward", 1 / t), ())] + [(products("forward", rest), (j,)) for j in range(k)],
                       [(gather_s, None)] * k)
        comms = [(gather_s, None)] * k + ([(scatter_s, j) for j in range(k)] if input_gradient else [])
        behind = _end_s([(input_piece(1 / k), ()) for _ in range(k)] + [(weight, tuple(range(k)))], comms)
    else:
        ahead = _end_s([(products("forward", 1 / k), ()) for _ in range(k)], [(scatter_s, j) for j in range(k)])
        computes = [(input_piece(1 / t), ())] + [(input_piece(rest), (j,)) for j in range(k)]
        behind = _end_s(computes + [(weight, tuple(range(k)))], [(gather_s, None)] * k)
    return ahead - forward, behind - input_piece(1.0) - weight


def piece_counts(slice_rows: int, t: int) -> list[int]:
    """The pieces a rank's slice of ``slice_rows`` can be cut into evenly, 2 up to the group's
    size (a ring's steps): the counts the search prices."""
    return [k for k in range(2, t + 1) if slice_rows % k == 0]


def _end_s(computes: list[tuple[float, tuple[int, ...]]], comms: list[tuple[float, int | None]]) -> float:
    """When the last of the products and of the collectives ends.
    ``computes``: (seconds, the collectives it waits for) in program order; ``comms``: (seconds,
    the product it moves, or None) in the order they start; each stream runs one at a time."""
    done_compute: list[float] = []
    done_comm: list[float] = []
    while len(done_compute) < len(computes) or len(done_comm) < len(comms):
        moved = False
        if len(done_compute) < len(computes):
            seconds, needs = computes[len(done_compute)]
            if all(n < len(done_comm) for n in needs):
                start = max([done_compute[-1] if done_compute else 0.0, *(done_comm[n] for n in needs)])
                done_compute.append(start + seconds)
                moved = True
        if len(done_comm) < len(comms):
            seconds, need = comms[len(done_comm)]
            if need is None or need < len(done_compute):
                ready = done_compute[need] if need is not None else 0.0
                done_comm.append(max(done_comm[-1] if done_comm else 0.0, ready) + seconds)
                moved = True
        assert moved, "a fused linear's order waits on itself"
    return max(done_compute[-1] if done_compute else 0.0, done_comm[-1] if done_comm else 0.0)


def linear_products(op_graph: OpGraph, name: str, t: int, cost_model: CostModel) -> Products:
    """``Products`` of the linear ``name`` split ``t`` ways: its kernels on that fraction of a t-th."""
    kernels = dict(zip(("forward", "input", "weight"), op_graph.kernels.get(name, ((), (), ()))))

    def seconds(which: str, fraction: float) -> float:
        share = fraction / t
        return cost_model.kernels_time([replace(k, flops=k.flops * share, bytes=k.bytes * share) for k in kernels[which]])

    return seconds


def _readers(op_graph: OpGraph, node: fx.Node) -> list[fx.Node]:
    """Who reads ``node`` in the generated code: sizes folded to constants do not."""
    return [user for user in node.users if not folded_number(op_graph, user)]


def gathered_input(op_graph: OpGraph, node: fx.Node, chosen: dict[str, Strategy]) -> fx.Node | None:
    """The input of a linear that no other reader takes as the linear does, whole with its
    gradient summed, under ``chosen`` (the block's strategies): the generated code then gathers it
    for the linear alone, inside ``gathered_linear``, when it comes split over the sequence (the
    codegen's ``_fuse_gathered_linears``). A reader that takes it split (a post-norm layer's
    residual add) does not share that gather; one past the block is taken to. None for any other
    node."""
    if op_name(node) != "linear" or is_aten(node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    x = node.args[0]
    if x in (argument(node, 1, "weight"), argument(node, 2, "bias")):
        return None
    if any(reader is not node and _takes_whole_copied(op_graph, reader, x, chosen) for reader in _readers(op_graph, x)):
        return None
    return x


def _takes_whole_copied(op_graph: OpGraph, reader: fx.Node, x: fx.Node, chosen: dict[str, Strategy]) -> bool:
    """Whether ``reader`` reads ``x`` replicated with its gradient summed (so shares its gather)."""
    strategy = chosen.get(reader.name)
    if strategy is None:
        return True  # past the block: its own block's layout is not known here
    required = strategy.inputs[reader.all_input_nodes.index(x)]
    return required == REPLICATE and strategy.copies(REPLICATE, op_graph.nodes[x.name].needs_grad)


_PRODUCTS = frozenset({"linear", "matmul", "mm", "bmm"})
"""Matrix products: on autocast's lower-precision list on every backend, so that under it each
casts every floating input it reads to the lower precision."""


def products_only(readers) -> bool:
    """Whether every one of ``readers`` is a matrix product (casts what it reads under autocast)."""
    readers = list(readers)
    return bool(readers) and all(op_name(reader) in _PRODUCTS for reader in readers)


_READ_THE_BATCH: weakref.WeakKeyDictionary[fx.Graph, frozenset[str]] = weakref.WeakKeyDictionary()  # per traced graph


def reads_the_batch(op_graph: OpGraph, value: str) -> bool:
    """Whether ``value``'s data is computed from the batch (an activation), not from weights and
    buffers alone (a weight, or a view or cast of one: ``w.t()``, ``w.type_as(x)``,
    ``w[:x.size(1)]``). Sizes, dtypes and devices read off the batch carry none of its data."""
    traced = op_graph.graph.module.graph
    names = _READ_THE_BATCH.get(traced)
    if names is None:
        found: set[str] = set()
        for node in traced.nodes:  # in topological order
            if node.op == "placeholder" or any(arg.name in found for arg in _data_inputs(op_graph, node)):
                found.add(node.name)
        names = _READ_THE_BATCH[traced] = frozenset(found)
    return value in names


_TAKES_ONLY_THE_DTYPE_OF_THE_REST = frozenset({"type_as", "to", "new_zeros", "new_ones", "new_empty", "new_full",
                                               "new_tensor", "zeros_like", "ones_like", "empty_like", "full_like"})


def _data_inputs(op_graph: OpGraph, node: fx.Node) -> list[fx.Node]:
    """The inputs whose values ``node``'s output is computed from: tensors, not a size or dtype
    read off one, nor the tensor whose dtype a cast (``w.type_as(x)``) or a new tensor takes."""
    tensors = [arg for arg in node.all_input_nodes if arg.name not in op_graph.nodes
               or op_graph.nodes[arg.name].output is not None or is_tuple_of_tensors(arg, op_graph)]
    if op_name(node) in _TAKES_ONLY_THE_DTYPE_OF_THE_REST:
        first = node.args[0] if node.args else None
        return [arg for arg in tensors if arg is first and op_name(node) in ("type_as", "to")]
    return tensors


def moves_for_products(op_graph: OpGraph, value: str, readers) -> bool:
    """Whether the gather of ``value`` from the sequence split that ``readers`` read, and the sum
    of the gradients they send back, move in the dtype the readers compute in: where ``value`` is
    an activation that only matrix products read (``tp.gather_for_products``,
    ``tp.copy_for_products``). A weight's gradient is summed in its own dtype."""
    return reads_the_batch(op_graph, value) and products_only(readers)


def moved_share(op_graph: OpGraph, value: str, *, products: bool) -> float:
    """What of ``value``'s bytes a collective moves where ``products`` (it moves as matrix products
    read it: ``gathered_linear`` always, otherwise ``moves_for_products``): under autocast, for an
    fp32 value (a norm's output, on autocast's fp32 list), the lower precision the products read,
    as the runtime casts it (``autopart.runtime.collectives.product_dtype``); else all of it."""
    low, meta = autocast_dtype(op_graph.dtype), op_graph.nodes[value].output
    if low is None or meta is None or meta.dtype != "float32" or not products:
        return 1.0
    return low.itemsize / 4


def fused_linears(op_graph: OpGraph, members: list[fx.Node], chosen: dict[str, Strategy],
                  placement_of: Callable[[str], Placement]) -> Iterator[FusedLinear]:
    """The linears of one block that the generated code fuses with their collectives, given the
    block's strategies; ``placement_of(name)``: how a value outside them arrives (a boundary).
    A block does not know the pipeline's cuts: a linear that reads what its stage receives, or
    makes what it sends, is priced here as fused and left whole by the code (the plan drops its
    pieces, ``autopart.solve.assemble``); a Transformer's cuts pass only the residual stream."""
    for node in members:
        strategy = chosen.get(node.name)
        x = gathered_input(op_graph, node, chosen)
        if strategy is not None and x is not None and strategy.inputs and strategy.inputs[0] == REPLICATE:
            source = chosen[x.name].output if x.name in chosen else placement_of(x.name)
            copy = strategy.copies(REPLICATE, op_graph.nodes[x.name].needs_grad)
            if copy and source.kind == "S" and source.groups == 1:
                yield FusedLinear("gathered", node.name, x.name, x.name, source.dim)
        scattered = _scattered_dim(op_graph, node, chosen, placement_of)
        if scattered is not None:
            yield FusedLinear("scattered", node.name, node.all_input_nodes[0].name, node.name, scattered)


def _scattered_dim(op_graph: OpGraph, node: fx.Node, chosen: dict[str, Strategy],
                   placement_of: Callable[[str], Placement]) -> int | None:
    """The sequence dimension a partial linear's output is reduce-scattered along, where that is
    all its readers want of it."""
    strategy = chosen.get(node.name)
    if (strategy is None or strategy.output.kind != "P" or op_name(node) != "linear" or is_aten(node)
            or argument(node, 2, "bias") is not None):
        return None
    wanted = set()
    for reader in _readers(op_graph, node):
        if reader.name in chosen:
            wanted.add(chosen[reader.name].inputs[reader.all_input_nodes.index(node)])
        else:  # read past the block, which takes it as a boundary
            wanted.add(placement_of(node.name))
    if len(wanted) != 1:
        return None
    (required,) = wanted
    return required.dim if required is not None and required.kind == "S" and required.groups == 1 else None


def fused_seconds(op_graph: OpGraph, members: list[fx.Node], chosen: dict[str, Strategy],
                  placement_of: Callable[[str], Placement], collective_s: Callable[..., float], *, t: int,
                  cost_model: CostModel, overlap: bool, priced_share: Callable[[str], float]) -> tuple[float, dict[str, int]]:
    """What a block's fused linears change of its conversions' seconds, which price each
    conversion alone (``autopart.solve.tensor``): a gathered linear gathers its slice again in
    backward; with ``overlap``, each fused linear is cut into the pieces that add least to its
    products, or not cut where even two pieces' collectives (each with its own latency) cost more
    than they hide. Also the pieces, per linear cut. ``collective_s(kind, value, share=1.0)``: one
    collective of a value's bytes (a share of them); ``priced_share(value)``: the share the
    conversion of a gathered linear's input priced (``moved_share``)."""
    change, cut = 0.0, {}
    for fused in fused_linears(op_graph, members, chosen, placement_of):
        moved = 1.0
        if fused.kind == "gathered":  # the conversion priced the gather and the gradient's reduce-scatter
            input_gradient = op_graph.nodes[fused.value].needs_grad
            share = priced_share(fused.value)
            priced = collective_s("all_gather", fused.value, share=share)
            priced += collective_s("reduce_scatter", fused.value, share=share) * input_gradient
            moved = moved_share(op_graph, fused.value, products=True)  # gathered_linear casts any fp32 slice
            gather, scatter = (collective_s(kind, fused.value, share=moved) for kind in ("all_gather", "reduce_scatter"))
            whole = 2 * gather + scatter * input_gradient  # and in backward the gather again
            change += whole - priced
        else:  # the pair's terms: the reduce-scatter, the gradient's gather
            input_gradient = op_graph.nodes[fused.input].needs_grad
            gather, scatter = (collective_s(kind, fused.value) for kind in ("all_gather", "reduce_scatter"))
            whole = scatter + gather * op_graph.nodes[fused.value].needs_grad
        if not overlap:
            continue
        products = linear_products(op_graph, fused.linear, t, cost_model)
        added = {
            k: sum(exposed_s(fused.kind, pieces=k, t=t, products=products, input_gradient=input_gradient,
                             gather_s=collective_s("all_gather", fused.value, share=moved / k),
                             scatter_s=collective_s("reduce_scatter", fused.value, share=moved / k)))
            for k in piece_counts(op_graph.nodes[fused.value].output.shape[fused.dim] // t, t)
        }  # fmt: skip
        best = min(added, key=added.get, default=None)
        if best is not None and added[best] < whole:
            change += added[best] - whole
            cut[fused.linear] = best
    return change, cut
