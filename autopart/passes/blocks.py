"""Cut the annotated graph into a chain of blocks at the points where a pipeline boundary may fall.

``build_blocks(op_graph) -> BlockChain``.

The compute nodes are kept in the graph's topological order. A boundary may fall between two
of them when everything that is live across it is a tensor (no Python ints, no tuples), its
elements are within ``NARROW_FACTOR`` of the narrowest such point in the whole graph, and no
more tensors cross it than cross the fewest-crossed of those points: in a Transformer these are
the residual stream alone, between sublayers. Nodes that depend only on the
batch and on buffers (position ids, masks, reshaped targets), the parameters and the inputs
belong to no block: every stage that needs them recomputes or holds them, so they never cross
a boundary. A parameter read on both sides of a boundary (tied embeddings) is held by both.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from torch import fx

from autopart.ir.tensors import TensorMeta
from autopart.passes.annotate import NodeCost, OpGraph

__all__ = ["Block", "Boundary", "BlockChain", "build_blocks", "NARROW_FACTOR"]

NARROW_FACTOR = 1.5
"""A boundary may carry at most this many times the bytes of the narrowest one."""


@dataclass(frozen=True, kw_only=True)
class Boundary:
    """What crosses from block k to block k+1, per microbatch."""

    tensors: tuple[tuple[str, TensorMeta], ...]

    @property
    def nbytes(self) -> int:
        return sum(meta.nbytes for _, meta in self.tensors)


@dataclass(frozen=True, kw_only=True)
class Block:
    index: int
    nodes: tuple[str, ...]
    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    forward_flops: float
    backward_flops: float
    saved_bytes: int
    selective_saved_bytes: int  # outputs of its matmuls and attention, which selective recompute keeps
    selective_recompute_s: float  # forward seconds of its other ops, which selective recompute runs again
    weight_seed_bytes: int  # what a split backward keeps from I to W (`autopart.passes.weight_seeds`)
    parameters: tuple[str, ...]  # get_attr node targets of the parameters the block reads
    signature: str  # equal for identical blocks (the repeated layers)

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s


@dataclass(frozen=True, kw_only=True)
class BlockChain:
    op_graph: OpGraph
    blocks: tuple[Block, ...]
    boundaries: tuple[Boundary, ...]  # boundaries[k] lies between blocks[k] and blocks[k + 1]
    parameter_bytes: dict[str, int]  # parameter target -> bytes

    def __len__(self) -> int:
        return len(self.blocks)

    @functools.cached_property
    def frozen_parameters(self) -> frozenset[str]:
        """The parameters that do not train (``requires_grad=False`` in the model), as the stage
        files declare them (``FROZEN``): no gradient, no optimizer state, no reduction."""
        module = self.op_graph.graph.module
        return frozenset(name for name in self.parameter_bytes if not module.get_parameter(name).requires_grad)


def _is_free(cost: NodeCost) -> bool:
    return cost.op in ("placeholder", "get_attr", "output") or cost.batch_derived


def build_blocks(op_graph: OpGraph) -> BlockChain:
    fx_nodes = op_graph.fx_nodes()
    costs = op_graph.nodes
    compute = [n for n in fx_nodes if not _is_free(costs[n.name])]
    position = {n.name: i for i, n in enumerate(compute)}
    last_use = {n.name: position[n.name] for n in compute}
    for n in compute:
        for user in n.users:
            # the output node uses the loss "after" the last compute node
            use = position.get(user.name, len(compute))
            last_use[n.name] = max(last_use[n.name], use)

    # crossing[i]: the values defined at or before i and used after i, for a cut after compute[i]
    crossing: list[list[str]] = []
    live: set[str] = set()
    for i, n in enumerate(compute):
        live.add(n.name)
        live = {name for name in live if last_use[name] > i}
        crossing.append(sorted(live, key=position.__getitem__))
    candidates = [
        i
        for i in range(len(compute) - 1)
        if crossing[i] and all(costs[name].output is not None for name in crossing[i])
    ]
    if candidates:
        # Widths in elements, not bytes: under autocast the 16-bit output of a sublayer beside the
        # fp32 residual stream would otherwise look as narrow as the stream alone, and the cuts
        # (and so the blocks the sharding solver sees) would depend on the precision.
        widths = {i: sum(costs[name].output.numel for name in crossing[i]) for i in candidates}
        narrowest = min(widths.values())
        candidates = [i for i in candidates if widths[i] <= NARROW_FACTOR * narrowest]
        # Where the stream alone is live, not beside a small side value (an RMSNorm's rsqrt).
        fewest = min(len(crossing[i]) for i in candidates)
        candidates = [i for i in candidates if len(crossing[i]) == fewest]

    parameter_bytes = {
        str(n.target): costs[n.name].parameter_bytes for n in fx_nodes if costs[n.name].is_parameter
    }
    for node, tensors in op_graph.leaf_tensors.items():  # the weights inside --leaf modules
        for name in op_graph.leaf_parameters(node):
            parameter_bytes[name] = tensors[name].nbytes
    blocks: list[Block] = []
    boundaries: list[Boundary] = []
    starts = [0, *(i + 1 for i in candidates)]
    ends = [*(i + 1 for i in candidates), len(compute)]
    for index, (start, end) in enumerate(zip(starts, ends)):
        members = compute[start:end]
        blocks.append(_make_block(index, members, op_graph))
        if end < len(compute):
            boundaries.append(Boundary(tensors=tuple((name, costs[name].output) for name in crossing[end - 1])))
    return BlockChain(
        op_graph=op_graph, blocks=tuple(blocks), boundaries=tuple(boundaries), parameter_bytes=parameter_bytes
    )


def _make_block(index: int, members: list[fx.Node], op_graph: OpGraph) -> Block:
    costs = op_graph.nodes
    names = tuple(n.name for n in members)
    inside = set(names)
    parameters: list[str] = []
    for n in members:
        for arg in n.all_input_nodes:
            if costs[arg.name].is_parameter and str(arg.target) not in parameters:
                parameters.append(str(arg.target))
        parameters.extend(p for p in op_graph.leaf_parameters(n.name) if p not in parameters)
    return Block(
        index=index,
        nodes=names,
        forward_s=sum(costs[n].forward_s for n in names),
        backward_input_s=sum(costs[n].backward_input_s for n in names),
        backward_weight_s=sum(costs[n].backward_weight_s for n in names),
        forward_flops=sum(costs[n].forward_flops for n in names),
        backward_flops=sum(costs[n].backward_flops for n in names),
        saved_bytes=sum(costs[n].saved_bytes for n in names),
        selective_saved_bytes=sum(costs[n].selective_saved_bytes for n in names),
        selective_recompute_s=sum(costs[n].selective_recompute_s for n in names),
        # a seed its reader keeps too is that one's, where a cut cannot fall between them
        weight_seed_bytes=sum(costs[n].weight_seed_bytes for n in names if costs[n].weight_seed_reader not in inside),
        parameters=tuple(parameters),
        signature=_signature(members, costs),
    )


def _signature(members: list[fx.Node], costs: dict[str, NodeCost]) -> str:
    """Names differ between repeated layers; ops, wiring, constants and shapes do not."""
    local = {n.name: i for i, n in enumerate(members)}

    def describe(arg: object) -> str:
        if isinstance(arg, fx.Node):
            if arg.name in local:
                return f"%{local[arg.name]}"
            meta = costs[arg.name].output
            return f"ext{tuple(meta.shape) if meta else ''}{meta.dtype if meta else ''}"
        if isinstance(arg, (list, tuple)):
            return "(" + ",".join(describe(a) for a in arg) + ")"
        if isinstance(arg, dict):
            return "{" + ",".join(f"{k}:{describe(v)}" for k, v in arg.items()) + "}"
        return repr(arg)

    text = ";".join(
        f"{n.op}:{getattr(n.target, '__name__', n.target)}:{describe(n.args)}:{describe(n.kwargs)}" for n in members
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]
