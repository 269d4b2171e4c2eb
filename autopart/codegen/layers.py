"""Find the repeated layers of a model, so that a stage program writes each one once.

``repeated_units(chain)`` looks at the block chain's signatures (identical blocks share one) for
the longest runs of a repeating group of consecutive blocks: in a Transformer the group is one
layer (its attention and its MLP sublayers), repeated once per layer. ``stage_units(...)`` then
finds, in one stage graph, the instances of those groups that the stage holds whole and that
can share one method: the same ops wired the same way, reading parameters at the same paths
under each layer's own module (``layers.0.attention.wq.weight`` and ``layers.1.attention.wq.weight``
are ``attention.wq.weight`` of ``layers.0`` and of ``layers.1``), with one output. An instance
that does not match is written out inline, so a match is never assumed.

``layer_methods(graph, units)`` names the instances whose module's tensors nothing outside their
method reads: those the runtime may make FSDP units of their own under ZeRO-3
(`autopart.runtime.fully_sharded`), since FSDP gathers such a module's parameters only around
the method's calls.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from torch import fx, nn

from autopart.passes.annotate import OpGraph
from autopart.passes.blocks import BlockChain

__all__ = ["Unit", "repeated_units", "stage_units", "relative_target", "layer_methods", "layer_parameters", "layer_instances"]

_LONGEST_PERIOD = 32
"""More blocks than this in one layer is not a repeated layer worth finding (and bounds the search)."""


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One instance of a repeated layer in a stage graph."""

    method: str  # the stage method that computes it, shared by the instances of one group
    prefix: str  # module path of this instance (``layers.0``): its parameters are under it
    nodes: tuple[str, ...]  # its stage-graph nodes, in graph order
    inputs: tuple[str, ...]  # values computed outside it, in the method's parameter order
    output: str  # the value it hands on


def repeated_units(chain: BlockChain) -> list[list[tuple[str, ...]]]:
    """Per repeating group, the node names of each of its instances, in chain order."""
    return [
        [tuple(n for block in chain.blocks[first:end] for n in block.nodes) for first, end in instances]
        for instances in _instances(chain)
    ]


def layer_parameters(chain: BlockChain) -> list[frozenset[str]]:
    """Per instance of a repeated layer, the parameters that no block outside it reads: what a
    stage holding it whole makes one FSDP unit at ZeRO-3 (``layer_methods``)."""
    return [own for _, _, own in layer_instances(chain)]


def layer_instances(chain: BlockChain) -> list[tuple[int, int, frozenset[str]]]:
    """Per instance of a repeated layer, its blocks (first, end) and ``layer_parameters``' set."""
    readers: dict[str, list[int]] = {}
    for k, block in enumerate(chain.blocks):
        for p in block.parameters:
            readers.setdefault(p, []).append(k)
    found = []
    for instances in _instances(chain):
        for first, end in instances:
            inside = {p for block in chain.blocks[first:end] for p in block.parameters}
            found.append((first, end, frozenset(p for p in inside if all(first <= k < end for k in readers[p]))))
    return found


def _instances(chain: BlockChain) -> list[list[tuple[int, int]]]:
    """Per repeating group, the (first, end) blocks of each of its instances, in chain order."""
    return _runs(tuple(block.signature for block in chain.blocks), tuple(tuple(b.parameters) for b in chain.blocks))


@functools.lru_cache(maxsize=16)
def _runs(signatures: tuple[str, ...], parameters: tuple[tuple[str, ...], ...]) -> list[list[tuple[int, int]]]:
    """``_instances`` of a chain by its blocks' signatures and parameters: kept, since the search
    asks for the chains of every micro-batch size and tensor-parallel degree, which share them."""
    runs: list[tuple[int, int, int]] = []
    segments = [(0, len(signatures))]
    while segments:
        lo, hi = segments.pop()
        run = _best_run(signatures, lo, hi, parameters)
        if run is not None:
            runs.append(run)
            start, period, count = run
            segments += [(lo, start), (start + period * count, hi)]
    return [[(start + k * period, start + (k + 1) * period) for k in range(count)] for start, period, count in sorted(runs)]


def _best_run(signatures: tuple[str, ...], lo: int, hi: int,
              parameters: tuple[tuple[str, ...], ...]) -> tuple[int, int, int] | None:
    """(start, period, count) of the run that covers most blocks of ``signatures[lo:hi]``; ties go to
    the run whose instances sit deepest in the module tree (whole layers, not a layer's second half
    and the next one's first), then to the shorter period."""
    best, best_key = None, None
    for period in range(1, min(_LONGEST_PERIOD, (hi - lo) // 2) + 1):
        # same[i - lo]: how many blocks from i on each equal the block a period after it, so a run
        # from i repeats 1 + same // period times: one pass per period, not one per start
        same = [0] * (hi - lo + 1)
        for i in range(hi - period - 1, lo - 1, -1):
            same[i - lo] = same[i - lo + 1] + 1 if signatures[i] == signatures[i + period] else 0
        for start in range(lo, hi - 2 * period + 1):
            count = min(1 + same[start - lo] // period, (hi - start) // period)
            if count < 2 or (best_key is not None and period * count < best_key[0]):
                continue
            read = [p for names in parameters[start : start + period] for p in names]
            depth = _prefix(read).count(".") + 1 if read else 0
            key = (period * count, depth, -period, -start)
            if best_key is None or key > best_key:
                best, best_key = (start, period, count), key
    return best


def _prefix(targets: list[str]) -> str:
    """The deepest module path that holds every one of ``targets``."""
    parts = [t.split(".")[:-1] for t in targets]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def relative_target(target: str, prefix: str) -> str | None:
    """``target`` under ``prefix`` (``attention.wq.weight``), or None when it is not under it."""
    return target[len(prefix) + 1 :] if prefix and target.startswith(prefix + ".") else None


def stage_units(
    graph: fx.Graph, stage_nodes: tuple[str, ...], groups: list[list[tuple[str, ...]]], op_graph: OpGraph,
    model: nn.Module | None,
) -> list[Unit]:
    """The instances of ``groups`` that the stage (its plan's ``stage_nodes``, written as ``graph``)
    holds whole and can compute with one method each."""
    nodes = list(graph.nodes)
    position = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    units: list[Unit] = []
    taken: set[str] = set()
    mine = set(stage_nodes)
    for instances in groups:
        held = [
            tuple(n for n in names if n in by_name)  # less the dead ops that the stage graph dropped
            for names in instances if mine.issuperset(names)
        ]  # fmt: skip
        found = [u for names in held if (u := _instance(names, by_name, position, op_graph)) is not None]
        if not found:
            continue
        template = found[0]
        members = [u for u in found if _same_program(template, u, by_name)]
        method = _method_name(template.prefix, model, taken)
        taken.add(method)
        units += [Unit(method=method, prefix=u.prefix, nodes=u.nodes, inputs=u.inputs, output=u.output) for u in members]
    return units


def _instance(names: tuple[str, ...], by_name: dict[str, fx.Node], position: dict[str, int], op_graph: OpGraph) -> Unit | None:
    members = set(names)
    # nodes that tensor parallelism inserted (collectives) belong to the instance whose ops use them
    for node in by_name.values():
        if node.name not in op_graph.nodes and node.users and all(u.name in members for u in node.users):
            members.add(node.name)
    ordered = sorted(members, key=position.__getitem__)
    inputs: list[str] = []
    outputs: list[fx.Node] = []
    parameters: list[str] = []
    for name in ordered:
        node = by_name[name]
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                if arg.name in op_graph.nodes and op_graph.nodes[arg.name].is_parameter:
                    parameters.append(str(arg.target))
            elif arg.name not in members and arg.name not in inputs:
                inputs.append(arg.name)
        if node.op == "call_module":
            parameters.append(str(node.target) + ".")
        if any(u.name not in members for u in node.users):
            outputs.append(node)
    if len(outputs) != 1 or not parameters:
        return None
    last = position[ordered[-1]]
    if any(position[u.name] < last for u in outputs[0].users if u.name not in members):
        return None
    prefix = _prefix(parameters)  # of the parameters: a buffer that every layer reads (rope tables) is the model's
    if not prefix:
        return None
    return Unit(method="", prefix=prefix, nodes=tuple(ordered), inputs=tuple(inputs), output=outputs[0].name)


def _same_program(template: Unit, other: Unit, by_name: dict[str, fx.Node]) -> bool:
    """Whether ``other`` runs exactly the ops of ``template``, on its own inputs and its own layer's parameters."""
    if len(template.nodes) != len(other.nodes) or len(template.inputs) != len(other.inputs):
        return False
    mapping = dict(zip(template.nodes, other.nodes)) | dict(zip(template.inputs, other.inputs))
    if template.output != other.output and mapping[template.output] != other.output:
        return False

    def same(a: object, b: object) -> bool:
        if isinstance(a, fx.Node) or isinstance(b, fx.Node):
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                return False
            if a.op == "get_attr" or b.op == "get_attr":
                return a.op == b.op and _attribute(a, template.prefix) == _attribute(b, other.prefix)
            return mapping.get(a.name) == b.name
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return type(a) is type(b) and a == b

    for mine, theirs in zip(template.nodes, other.nodes):
        a, b = by_name[mine], by_name[theirs]
        target_a = relative_target(str(a.target), template.prefix) if a.op == "call_module" else a.target
        target_b = relative_target(str(b.target), other.prefix) if b.op == "call_module" else b.target
        if a.op != b.op or target_a != target_b or not same(a.args, b.args) or not same(a.kwargs, b.kwargs):
            return False
    return True


def _attribute(node: fx.Node, prefix: str) -> str:
    relative = relative_target(str(node.target), prefix)
    return f"layer.{relative}" if relative is not None else f"self.{node.target}"


def _method_name(prefix: str, model: nn.Module | None, taken: set[str]) -> str:
    """``transformer_block`` for a ``TransformerBlock``: the method reads as the model's class."""
    name = "block"
    if model is not None:
        try:
            name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", type(model.get_submodule(prefix)).__name__).lower()
        except AttributeError:
            pass
    if not name.isidentifier() or hasattr(nn.Module, name) or name in ("forward", "layer", "self"):
        name = f"{name}_block" if name.isidentifier() else "block"
    top = prefix.split(".")[0]
    while name in taken or name == top:
        name += "_"
    return name


def layer_methods(graph: fx.Graph, units: list[Unit]) -> dict[str, tuple[str, ...]]:
    """Per layer method, the module paths of the instances whose tensors only that method reads
    (a tensor under ``layers.0`` that the forward also read inline would be sharded there)."""
    found: dict[str, tuple[str, ...]] = {}
    for unit in units:
        members = set(unit.nodes)
        under = [n for n in graph.nodes
                 if n.op in ("get_attr", "call_module") and relative_target(str(n.target), unit.prefix) is not None]
        if not any(_read_outside(n, members) for n in under):
            found[unit.method] = (*found.get(unit.method, ()), unit.prefix)
    return found


def _read_outside(node: fx.Node, members: set[str]) -> bool:
    if node.op == "call_module":  # a --leaf module of the layer, called by whoever holds the node
        return node.name not in members
    return any(user.name not in members for user in node.users)
