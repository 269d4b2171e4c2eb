"""Split the training graph by a plan's stages: one fx graph per stage.

``stage_graphs(graph, plan)`` builds, for every stage, an fx graph whose inputs are the tensors
it receives followed by the graph inputs it reads from the batch, and whose output is the
tuple of tensors it sends on (the loss, on the last stage). Nodes that depend only on the batch
and on buffers are recomputed on every stage that needs them, parameters are held by every
stage that reads them. ``autopart.codegen.stage_file`` writes one such graph as Python source.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx, nn

from autopart.ir.tensors import TensorMeta
from autopart.passes.annotate import OpGraph
from autopart.passes.buffer_writes import writes_in_place, written_attributes
from autopart.codegen.names import plain_text
from autopart.ir.errors import PlanError

__all__ = ["StageGraph", "kept_unread", "updated_buffers", "stage_graphs", "stage_boundaries", "describe_tensors"]


def kept_unread(node: fx.Node) -> bool:
    """A node that a stage runs though nothing reads its value: one fx calls impure, or an in-place
    op (``att.masked_fill_(mask, -inf)``, ``x.add_(bias)``, ``F.relu(x, inplace=True)``), whose
    effect is on its input, which fx's dead-code pass takes for pure and would drop (the mask
    lost, the bias never trained). A graph without its module cannot ask a leaf module's call
    whether it is pure: it is."""
    if node.op == "call_module":
        return False
    return node.is_impure() or writes_in_place(node)


def updated_buffers(stage: StageGraph, root: nn.Module) -> tuple[str, ...]:
    """The stage's buffers that its forward writes (`autopart.passes.buffer_writes`: an in-place
    op's written argument or a view of it, a batch norm's running statistics in training), and
    every buffer of the --leaf modules it holds (``root``'s submodules), whose code is unseen here.
    The runtime moves each once a step (`autopart.runtime.buffer_updates`) and tracks no other."""
    written = written_attributes(stage.graph)
    leaves = tuple(f"{leaf}.{name}" for leaf in stage.leaves for name, _ in root.get_submodule(leaf).named_buffers())
    return tuple(name for name in stage.buffers if name in written) + leaves


@dataclass(frozen=True, kw_only=True)
class StageGraph:
    index: int
    graph: fx.Graph
    inputs: tuple[str, ...]  # received tensors
    batch_inputs: tuple[str, ...]
    outputs: tuple[str, ...]  # sent tensors, or the loss on the last stage
    parameters: tuple[str, ...]  # get_attr targets that are parameters
    buffers: tuple[str, ...]  # get_attr targets that are buffers of the model
    constants: tuple[str, ...] = ()  # get_attr targets made in forward (not the model's): part of the program
    leaves: tuple[str, ...] = ()  # call_module targets: --leaf modules that the stage owns whole


def _free(op_graph: OpGraph, name: str) -> bool:
    cost = op_graph.nodes[name]
    return cost.op in ("placeholder", "get_attr") or cost.batch_derived


def stage_boundaries(op_graph: OpGraph, stage_nodes: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """For each stage, the compute values it must send on: defined at or before it, used after it."""
    fx_nodes = {n.name: n for n in op_graph.fx_nodes()}
    stage_of: dict[str, int] = {}
    for s, names in enumerate(stage_nodes):
        for name in names:
            if name not in fx_nodes or _free(op_graph, name):
                raise PlanError(f"plan stage {s} lists node {name!r}, which is not a compute node of this model's graph")
            if name in stage_of:
                raise PlanError(f"plan lists node {name!r} in stages {stage_of[name]} and {s}; each node belongs to one")
            stage_of[name] = s
    missing = [n for n in fx_nodes if n not in stage_of and not _free(op_graph, n) and fx_nodes[n].op != "output"]
    if missing:
        raise PlanError(f"plan assigns no stage to node {missing[0]!r} (and {len(missing) - 1} more); recompile")
    last = len(stage_nodes) - 1
    order = {n: i for i, n in enumerate(fx_nodes)}
    sends: list[set[str]] = [set() for _ in stage_nodes]
    for name, s in stage_of.items():
        for user in fx_nodes[name].users:
            used_at = last if user.op == "output" else stage_of.get(user.name)
            if used_at is None:  # a batch-derived user cannot consume a compute value
                raise AssertionError(f"free node {user.name} depends on compute node {name}")
            if used_at < s:
                raise PlanError(f"plan puts {user.name!r} on stage {used_at} before its input {name!r} on stage {s}")
            for boundary in range(s, used_at):
                sends[boundary].add(name)
    for s in range(last):
        for name in sends[s]:
            if op_graph.nodes[name].output is None:
                raise PlanError(
                    f"the cut after stage {s} would send {name!r}, which is not a single tensor; move the cut"
                )
    return [tuple(sorted(names, key=order.__getitem__)) for names in sends[:last]]


def stage_graphs(op_graph: OpGraph, stage_nodes: list[tuple[str, ...]]) -> list[StageGraph]:
    source = op_graph.graph.module.graph
    fx_nodes = {n.name: n for n in source.nodes}
    boundaries = stage_boundaries(op_graph, stage_nodes)
    output_node = next(n for n in source.nodes if n.op == "output")
    loss = output_node.args[0]
    # each stage walks its own nodes in the source's order, not the whole graph: a thousand
    # layers over a hundred stages made that walk quadratic
    order = {n.name: i for i, n in enumerate(source.nodes)}
    placeholders = [n.name for n in source.nodes if n.op == "placeholder"]
    constants = set(op_graph.graph.constants)
    result = []
    for s, names in enumerate(stage_nodes):
        received = boundaries[s - 1] if s > 0 else ()
        sends = boundaries[s] if s < len(boundaries) else (loss.name,)
        members = set(names)
        needed: set[str] = set()

        def pull(node: fx.Node) -> None:
            for arg in node.all_input_nodes:
                if arg.name in members or arg.name in received or arg.name in needed:
                    continue
                assert _free(op_graph, arg.name), f"stage {s} reads {arg.name} without receiving it"
                needed.add(arg.name)
                pull(arg)

        for name in names:
            pull(fx_nodes[name])
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        for name in received:
            env[name] = graph.placeholder(name)
            env[name].meta = dict(fx_nodes[name].meta)
        batch_inputs = tuple(name for name in placeholders if name in needed)
        for name in batch_inputs:
            env[name] = graph.placeholder(name)
        parameters, buffers, leaves = [], [], []
        for name in sorted(needed | members, key=order.__getitem__):
            node = fx_nodes[name]
            if node.op == "placeholder" or name in received:
                continue
            env[name] = graph.node_copy(node, lambda n: env[n.name])
            if node.op == "get_attr":
                (parameters if op_graph.nodes[name].is_parameter else buffers).append(str(node.target))
            if node.op == "call_module":
                leaves.append(str(node.target))
        graph.output(env[sends[0]] if s == len(stage_nodes) - 1 else tuple(env[n] for n in sends))
        graph.eliminate_dead_code(is_impure_node=kept_unread)
        graph.lint()
        result.append(
            StageGraph(
                index=s,
                graph=graph,
                inputs=received,
                batch_inputs=batch_inputs,
                outputs=sends,
                parameters=tuple(dict.fromkeys(parameters)),
                buffers=tuple(b for b in dict.fromkeys(buffers) if b not in constants),
                constants=tuple(b for b in dict.fromkeys(buffers) if b in constants),
                leaves=tuple(dict.fromkeys(leaves)),
            )
        )
    return result


def describe_tensors(names: tuple[str, ...], op_graph: OpGraph, held: dict[str, TensorMeta] | None = None,
                     tp: int = 1) -> str:
    """``names`` with their shapes and dtypes; ``held``: the plan's record of those that the
    tensor-parallel ranks hold split (a slice each along a dim), which the text says."""
    parts = []
    for name in names:
        meta: TensorMeta | None = op_graph.nodes[name].output
        dim = getattr((held or {}).get(name), "split_dim", None)
        how = f", split {tp} ways along dim {dim} (one slice per rank)" if dim is not None else ""
        parts.append(plain_text(f"{name} {tuple(meta.shape) if meta else ''} {meta.dtype if meta else ''}".strip() + how))
    return ", ".join(parts) or "nothing"

