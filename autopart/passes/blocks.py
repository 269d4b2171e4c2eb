"""Cut the annotated graph into a chain of blocks at the points where a pipeline boundary may fall.

``build_blocks(op_graph) -> BlockChain``.

The compute nodes are kept in the graph's topological order. A boundary may fall between two
of them when everything that is live across it is a tensor (no Python ints, no tuples), the
activations among them are within ``NARROW_FACTOR`` of the narrowest point in the model, and no
more activations cross it than cross the fewest-crossed of those points: in a Transformer these
are the residual stream alone, between sublayers.

An activation is a value that some later op reading a weight depends on. What else is live (a
loss term already computed, a running auxiliary loss that each MoE layer adds to, a side output
that the loss adds) is on its way to the loss alone: it crosses whichever boundary it is live at,
and is sent and costed there, but it says nothing of where a layer ends, so the width and the
count leave it out. Counted, the point after a z-loss's two scalars exist (two elements) would be
the narrowest in the graph, with every residual-stream cut too wide beside it, and a per-layer
auxiliary scalar beside the stream would make each layer boundary one tensor more than the few
points before the first layer's scalar exists: either leaves no cut between layers.

"The narrowest point in the model" is taken over the points that some activation crosses, those
before the last op that reads a weight. A point after it (the head's output on its way into the
loss, the loss's own arithmetic) is measured by all it carries and may still be a boundary where
it is as narrow as the model's, as a cut that leaves a stage the loss alone; it never sets the
width that the layer cuts are held to, since a classifier's head (a few outputs per sample) is
narrower than any layer's stream and would throw every layer cut away. For the same reason the
points after a pooling (the last fall in width, made by an op that reads no weight: a CNN's mean
over the image, a ViT's first token) set no width either.

Nodes that depend only on the batch and on buffers (position ids, masks, reshaped targets), the
parameters and the inputs belong to no block: every stage that needs them recomputes or holds
them, so they never cross a boundary. A parameter read on both sides of a boundary (tied
embeddings) is held by both, and so is a buffer: a block's buffers are those its ops read
directly or through such nodes (a causal mask sliced to the sequence), as the stage that holds
the block holds them (`autopart.codegen.stages.stage_graphs`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import fx

from autopart.ir.tensors import TensorMeta
from autopart.passes.annotate import NodeCost, OpGraph
from autopart.passes.buffer_writes import written_attributes
from autopart.predict.memory import held_buffer_bytes

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
    # the buffers (and tensors made in forward) that its stage holds for it: get_attr targets read
    # through the batch- and buffer-derived nodes, and the buffers of its --leaf modules
    buffers: tuple[str, ...] = ()

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s


@dataclass(frozen=True, kw_only=True)
class BlockChain:
    op_graph: OpGraph
    blocks: tuple[Block, ...]
    boundaries: tuple[Boundary, ...]  # boundaries[k] lies between blocks[k] and blocks[k + 1]
    parameter_bytes: dict[str, int]  # parameter target -> bytes
    # buffer -> what a stage that holds it holds for it (`autopart.predict.memory.held_buffer_bytes`)
    buffer_bytes: dict[str, int] = dataclasses.field(default_factory=dict)

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
    candidates = _cut_points(compute, crossing, op_graph)

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
        op_graph=op_graph, blocks=tuple(blocks), boundaries=tuple(boundaries), parameter_bytes=parameter_bytes,
        buffer_bytes=_buffer_bytes(op_graph, blocks),
    )


def _buffer_bytes(op_graph: OpGraph, blocks: list[Block]) -> dict[str, int]:
    """Per buffer that some block holds, what its stage holds for it: updated, where the forward
    writes it (`autopart.codegen.stages.updated_buffers`: the graph's writes, and every buffer of a
    --leaf module), the constants made in forward excepted."""
    held = {name for block in blocks for name in block.buffers}
    metas = {str(n.target): op_graph.nodes[n.name].output for n in op_graph.fx_nodes()
             if n.op == "get_attr" and op_graph.nodes[n.name].is_buffer}
    updated = written_attributes(op_graph.graph.module.graph) - set(op_graph.graph.constants)
    for tensors in op_graph.leaf_tensors.values():
        leaf_buffers = {name: meta for name, meta in tensors.items() if name not in metas and name in held}
        metas.update(leaf_buffers)
        updated |= set(leaf_buffers)
    return {name: held_buffer_bytes(metas[name], updated=name in updated) for name in sorted(held) if name in metas}


def _cut_points(compute: list[fx.Node], crossing: list[list[str]], op_graph: OpGraph) -> list[int]:
    """The indices i at which a boundary may fall after ``compute[i]`` (see the module's docstring)."""
    costs = op_graph.nodes
    weight_use = _last_weight_use(compute, op_graph)
    measured: dict[int, list[str]] = {}  # per possible point, the values its width and count are of
    inside: list[int] = []  # the points some activation crosses: those before the last op that reads a weight
    for i in range(len(compute) - 1):
        if crossing[i] and all(costs[name].output is not None for name in crossing[i]):
            activations = [name for name in crossing[i] if weight_use.get(name, -1) > i]
            measured[i] = activations or crossing[i]
            if activations:
                inside.append(i)
    if not measured:
        return []
    # Widths in elements, not bytes: under autocast the 16-bit output of a sublayer beside the
    # fp32 residual stream would otherwise look as narrow as the stream alone, and the cuts
    # (and so the blocks the sharding solver sees) would depend on the precision.
    widths = {i: sum(costs[name].output.numel for name in names) for i, names in measured.items()}
    # a model of one weighted op has only its loss's points
    reference = set(_before_the_pooling(inside, widths, compute, op_graph)) or set(measured)
    narrowest = min(widths[i] for i in reference)
    narrow = [i for i in measured if widths[i] <= NARROW_FACTOR * narrowest]
    # Where the stream alone is live, not beside a small side value (an RMSNorm's rsqrt).
    fewest = min(len(measured[i]) for i in narrow if i in reference)
    runs: list[list[int]] = []  # points in a row that carry the same activations
    for i in (i for i in narrow if len(measured[i]) <= fewest):
        if runs and measured[runs[-1][-1]] == measured[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return _one_point_per_run(runs, compute, costs)


def _before_the_pooling(inside: list[int], widths: dict[int, int], compute: list[fx.Node],
                        op_graph: OpGraph) -> list[int]:
    """The points that set the width the layer cuts are held to: all of ``inside`` but those after
    the model's last fall in width, where an op that reads no weight makes it (a classifier's
    pooling: a CNN's mean over the image, a ViT's or BERT's first token). The pooled features are
    narrower than any layer's stream, and as the reference they would throw every layer cut away
    (``--pp 2`` gave the last stage the head alone; ``--stage-layers`` counted one layer). A fall
    made by a weight (a funnel's linears) is the model's own narrow point and stays."""
    later = 0  # the widest point after the one at hand
    for k in range(len(inside) - 1, 0, -1):
        later = max(later, widths[inside[k]])
        fall = inside[k - 1]
        if widths[fall] > NARROW_FACTOR * later:
            return inside if any(map(_weight_readers(op_graph), compute[fall + 1 : inside[k] + 1])) else inside[:k]
    return inside


def _one_point_per_run(runs: list[list[int]], compute: list[fx.Node], costs: dict[str, NodeCost]) -> list[int]:
    """Between two points that carry the same activations lie only ops on the way to the loss (a
    layer's auxiliary term, its running sum): a cut between them would make a block of those
    alone, a stage that holds no weight and that a solver may still choose where every stage's
    time is mostly its transfers. So one point of each run is a boundary: the last, so that the
    ops go with the layer whose output they are computed from and each layer's block holds its
    own term alike; or the first, where only that makes the block before it one of the repeated
    layers (a term computed once, from the last layer's output), since the stage programs write a
    repeated layer once and ``--stage-layers`` counts them."""
    if all(len(run) == 1 for run in runs):
        return [run[0] for run in runs]
    cuts: list[int] = []
    seen: set[str] = set()  # the signatures of the blocks so far
    start = 0
    for run in runs:
        point = run[-1]
        if len(run) > 1:
            early, late = (_signature(compute[start : i + 1], costs) for i in (run[0], run[-1]))
            if early in seen and late not in seen:
                point = run[0]
        seen.add(_signature(compute[start : point + 1], costs))
        cuts.append(point)
        start = point + 1
    return cuts


def _last_weight_use(compute: list[fx.Node], op_graph: OpGraph) -> dict[str, int]:
    """Per compute node on the way to a weight, the position of its last user that is: one that
    reads a weight (a parameter, a value made from parameters alone such as a transposed tied
    head, or a --leaf module's own), or one that is itself on the way to a weight. A value live at
    a point after that position is carried to the loss alone."""
    position = {n.name: i for i, n in enumerate(compute)}
    reads_weights = _weight_readers(op_graph)
    last: dict[str, int] = {}
    for node in reversed(compute):  # every user of a compute node comes after it
        uses = [position[user.name] for user in node.users
                if user.name in position and (user.name in last or reads_weights(user))]
        if uses:
            last[node.name] = max(uses)
    return last


def _weight_readers(op_graph: OpGraph) -> Callable[[fx.Node], bool]:
    """Whether a node reads a weight: a parameter, a value made from parameters alone (a transposed
    tied head), or a --leaf module's own."""
    costs = op_graph.nodes
    weights: set[str] = set()
    for node in op_graph.fx_nodes():
        if costs[node.name].is_parameter:
            weights.add(node.name)
        elif node.op in ("call_function", "call_method"):
            tensors = [arg.name for arg in node.all_input_nodes if costs[arg.name].output is not None]
            if tensors and all(name in weights for name in tensors):  # sizes read from activations aside
                weights.add(node.name)

    def reads_weights(node: fx.Node) -> bool:
        return bool(op_graph.leaf_parameters(node.name)) or any(arg.name in weights for arg in node.all_input_nodes)

    return reads_weights


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
        buffers=_block_buffers(members, op_graph, set(parameters)),
    )


def _block_buffers(members: list[fx.Node], op_graph: OpGraph, parameters: set[str]) -> tuple[str, ...]:
    """The buffers that the stage holding ``members`` holds for them (``Block.buffers``)."""
    costs, found, seen = op_graph.nodes, [], set()
    stack = [arg for n in members for arg in n.all_input_nodes]
    for n in members:
        found += [name for name in op_graph.leaf_tensors.get(n.name, {}) if name not in parameters]
    while stack:
        node = stack.pop()
        if node.name in seen or not _is_free(costs[node.name]):
            continue
        seen.add(node.name)
        if node.op == "get_attr" and costs[node.name].is_buffer:
            found.append(str(node.target))
        stack.extend(node.all_input_nodes)
    return tuple(dict.fromkeys(found))


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
