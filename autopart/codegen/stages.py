"""Split the training graph by a plan's stages and write one readable nn.Module per stage.

``stage_graphs(graph, plan)`` builds, for every stage, an fx graph whose inputs are the tensors
it receives followed by the graph inputs it reads from the batch, and whose output is the
tuple of tensors it sends on (the loss, on the last stage). Nodes that depend only on the batch
and on buffers are recomputed on every stage that needs them, parameters are held by every
stage that reads them. ``stage_source(...)`` turns one such graph into Python source.
"""

from __future__ import annotations

import builtins
import re
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.graph import _custom_builtins

from autopart.ir.tensors import TensorMeta
from autopart.passes.annotate import OpGraph
from autopart.codegen.names import plain_text
from autopart.ir.errors import PlanError

__all__ = ["StageGraph", "stage_graphs", "stage_boundaries", "stage_source"]


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
        batch_inputs = tuple(n.name for n in source.nodes if n.op == "placeholder" and n.name in needed)
        for name in batch_inputs:
            env[name] = graph.placeholder(name)
        parameters, buffers, leaves = [], [], []
        constants = set(op_graph.graph.constants)
        for node in source.nodes:
            if node.op == "placeholder" or node.name in received:
                continue
            if node.name in needed or node.name in members:
                env[node.name] = graph.node_copy(node, lambda n: env[n.name])
                if node.op == "get_attr":
                    (parameters if op_graph.nodes[node.name].is_parameter else buffers).append(str(node.target))
                if node.op == "call_module":
                    leaves.append(str(node.target))
        graph.output(env[sends[0]] if s == len(stage_nodes) - 1 else tuple(env[n] for n in sends))
        # a graph without its module cannot ask a leaf module's call whether it is pure: it is
        graph.eliminate_dead_code(is_impure_node=lambda n: n.op != "call_module" and n.is_impure())
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


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _dotted(name: str) -> bool:
    return all(_IDENTIFIER.match(part) for part in name.split("."))


def _import_line(name: str, value: Any) -> str:
    """An import that binds ``name`` to ``value`` in the generated file."""

    if name in _custom_builtins:
        return _custom_builtins[name].import_str
    if isinstance(value, types.ModuleType):
        if not _dotted(value.__name__):
            raise PlanError(f"generated code would import module {value.__name__!r}, which is no module path")
        return f"import {value.__name__} as {name}" if value.__name__ != name else f"import {name}"
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if getattr(builtins, name, None) is value:
        return ""
    if not module or not qualname or not _dotted(module) or not _dotted(qualname):
        raise PlanError(f"generated code would need {value!r}, which cannot be imported by name; report this model")
    top, _, rest = qualname.partition(".")
    if not rest:
        return f"from {module} import {top} as {name}" if top != name else f"from {module} import {top}"
    return f"import {module}\n{name} = {module}.{qualname}"


def stage_source(
    stage: StageGraph,
    *,
    stages: int,
    op_graph: OpGraph,
    metas: dict[str, torch.Tensor],
    header: str,
) -> str:
    """Python source of one stage: a module docstring, the tensor declarations, the forward code."""
    forward, imports = _forward_code(stage, op_graph)
    class_name = f"Stage{stage.index}"

    def declarations(names: tuple[str, ...]) -> str:
        return _declarations(names, metas)

    declare_leaves = (
        "\n        declare_leaves(self, LEAVES, Path(__file__).resolve().parents[1] / \"model.py\")" if stage.leaves else ""
    )

    def signature(names: tuple[str, ...]) -> str:
        return ", ".join(repr(n) for n in names) + ("," if len(names) == 1 else "")

    body = "\n".join("    " + line if line else "" for line in forward.splitlines())
    constant_block = (
        f"""# tensors that the model makes in forward, captured as constants; loaded from weights/
CONSTANTS = {{
{declarations(stage.constants)}}}
"""
        if stage.constants
        else ""
    )
    root = op_graph.graph.module
    leaves = "".join(f"    {t!r}: {type(root.get_submodule(t)).__name__!r},\n" for t in stage.leaves)
    leaf_block = (
        f"""
# module path -> its class in model.py: kept whole (--leaf); built by model.py's build_model()
# on the meta device, then given this stage's weights like every other tensor
LEAVES = {{
{leaves}}}
"""
        if stage.leaves
        else ""
    )
    return f'''{header}
{"".join(line + chr(10) for line in imports)}{"from pathlib import Path" + chr(10) + chr(10) if stage.leaves else ""}import torch

from autopart.runtime.stage import {"declare_leaves, " if stage.leaves else ""}declare_tensors

# name in the original model -> (shape, dtype); values from weights/, train.py --weights CKPT, or
# (a model built on the meta device) the model's initialisers, run on this rank
PARAMETERS = {{
{declarations(stage.parameters)}}}
BUFFERS = {{
{declarations(stage.buffers)}}}
{constant_block}{leaf_block}

class {class_name}(torch.nn.Module):
    """Stage {stage.index} of {stages}."""

    inputs = ({signature(stage.inputs)})  # received from stage {stage.index - 1}
    batch_inputs = ({signature(stage.batch_inputs)})  # read from the batch
    outputs = ({signature(stage.outputs)})  # {"the loss" if stage.index == stages - 1 else f"sent to stage {stage.index + 1}"}

    def __init__(self):
        super().__init__()
        declare_tensors(self, PARAMETERS, BUFFERS{", CONSTANTS" if stage.constants else ""}){declare_leaves}

{body}


STAGE = {class_name}
'''


def _forward_code(stage: StageGraph, op_graph: OpGraph) -> tuple[str, list[str]]:
    """The stage's forward as fx writes it, with collectives read as ``tp.<name>`` and each op's
    module path in a comment; and the import lines it needs besides torch's."""
    code = stage.graph.python_code(root_module="self")
    src = code.src
    used = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", src))
    imports = set()
    for name, value in code.globals.items():
        if name not in used:
            continue
        if getattr(value, "__module__", None) == "autopart.runtime.collectives":  # read as tp.all_reduce(x)
            src = re.sub(rf"\b{name}\(", f"tp.{value.__name__}(", src)
            imports.add("from autopart.runtime import collectives as tp")
        elif line := _import_line(name, value):
            imports.add(line)
    return _comment_module_paths(src.strip("\n"), op_graph), sorted(imports - {"import torch"})


def _declarations(names: tuple[str, ...], metas: dict[str, torch.Tensor]) -> str:
    """One ``name: (shape, dtype),`` line per tensor, as the stage's tables declare them."""
    lines = []
    for target in names:
        tensor = metas[target]
        dtype = str(tensor.dtype).removeprefix("torch.")
        lines.append(f"    {target!r}: ({tuple(tensor.shape)!r}, torch.{dtype}),")
    return "".join(line + "\n" for line in lines)


def _comment_module_paths(source: str, op_graph: OpGraph) -> str:
    """Put a ``# <module path>`` line wherever the code moves into another module of the model."""
    lines, current = [], None
    assignment = re.compile(r"^\s+([A-Za-z_][A-Za-z0-9_]*) = ")
    for line in source.splitlines():
        match = assignment.match(line)
        if match and match.group(1) in op_graph.nodes:
            path = op_graph.nodes[match.group(1)].module_path
            if path and path != current:
                lines.append(f"    # {plain_text(path)}")
            current = path or current
        lines.append(line)
    return "\n".join(lines)


def describe_tensors(names: tuple[str, ...], op_graph: OpGraph) -> str:
    parts = []
    for name in names:
        meta: TensorMeta | None = op_graph.nodes[name].output
        parts.append(plain_text(f"{name} {tuple(meta.shape) if meta else ''} {meta.dtype if meta else ''}".strip()))
    return ", ".join(parts) or "nothing"

