"""The source of one stage program: its tensors, its forward, and one method per repeated layer.

The forward reads as the model does: the layers that the stage holds whole are calls of one
method each (``x = self.transformer_block(x, self.layers[0])``, as nanoGPT's ``Block``), given
the layer's module, so its parameters keep their names in the original model and the stage's
state dict stays a slice of the model's. Everything else is written inline, op by op.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from autopart.passes.annotate import OpGraph
from autopart.passes.buffer_writes import written_inputs
from autopart.codegen.layers import Unit, layer_methods, relative_target
from autopart.codegen.names import plain_text
from autopart.codegen.program import (
    VIEW_OPS, Expressions, Memory, Step, attribute_path, function_lines, large, shape_comment,
)
from autopart.solve.sharding import op_name
from autopart.codegen.stages import StageGraph, updated_buffers

__all__ = ["stage_source", "stage_body"]

_RESERVED = {"F", "torch", "tp", "overlapped", "math", "self", "layer", "Path", "x"}
"""Names the generated code binds itself: a value named so by fx is renamed."""


_SAME_SHAPE = {"all_reduce", "copy_to_tp", "copy_weight_to_tp", "copy_for_products"}


class _Writer:
    """The forward and the layer methods of one stage graph."""

    def __init__(self, stage: StageGraph, op_graph: OpGraph, units: list[Unit], shapes: dict[str, tuple[tuple[int, ...], str]]):
        self.stage, self.op_graph, self.units, self.shapes = stage, op_graph, units, shapes
        self.nodes = {n.name: n for n in stage.graph.nodes}
        self.unit_of = {name: unit for unit in units for name in unit.nodes}
        self.leaves = stage.leaves
        taken = set(_RESERVED)
        self.expressions = Expressions(variable=self._variable, attribute=self._attribute)
        for node in stage.graph.nodes:  # function names first: a value never shadows one
            if (callee := self.expressions.callee(node)) is not None:
                taken.add(callee.split(".")[0])
        self.names = {}
        for node in stage.graph.nodes:
            name = node.name
            while name in taken:
                name += "_"
            self.names[node.name] = name
        self.own_names = dict(self.names)
        self.prefix = ""  # the layer whose method is being written

    def _variable(self, node: fx.Node) -> str:
        return self.names[node.name]

    def _indexable(self, path: str) -> bool:
        """Containers that the stage made (``autopart.runtime.stage``) index by number; the stage
        module itself (path "") and a --leaf's own modules need not."""
        return bool(path) and not any(path == leaf or path.startswith(leaf + ".") for leaf in self.leaves)

    def _attribute(self, node: fx.Node) -> str:
        target = str(node.target)
        relative = relative_target(target, self.prefix)
        if relative is not None:
            return attribute_path("layer", relative, indexable=lambda p: self._indexable(f"{self.prefix}.{p}" if p else self.prefix))
        return attribute_path("self", target, indexable=self._indexable)

    def _memory(self, inputs: list[str], outputs: list[str]) -> Memory:
        sizes = {name: math.prod(shape) for name, (shape, _) in self.shapes.items()}
        roots: dict[str, str] = {}
        for node in self.stage.graph.nodes:
            tensors = [a for a in node.all_input_nodes if a.op != "get_attr"]
            aliased = node.op in ("call_function", "call_method") and op_name(node) in VIEW_OPS and tensors
            roots[node.name] = roots[tensors[0].name] if aliased else node.name
        threshold = max((sizes.get(n, 0) for n in [*inputs, *outputs]), default=0)
        return Memory(sizes=sizes, roots=roots, threshold=max(threshold, 1))

    def _comment(self, name: str) -> str:
        node = self.nodes[name]
        if name not in self.shapes and op_name(node) in _SAME_SHAPE and node.args[0].name in self.shapes:
            return shape_comment(*self.shapes[node.args[0].name])  # a collective that keeps its input's shape
        return shape_comment(*self.shapes[name]) if name in self.shapes else ""

    def _step(self, node: fx.Node, path: str | None) -> Step:
        uses = tuple(a.name for a in node.all_input_nodes if a.op != "get_attr")
        text = f"{self.names[node.name]} = {self.expressions.of(node)}"
        return Step(defines=node.name, text=text, uses=uses, large=large(node), comment=self._comment(node.name), path=path)

    def _path(self, name: str) -> str | None:
        cost = self.op_graph.nodes.get(name)
        if cost is None:
            return None
        if not self.prefix:
            return plain_text(cost.module_path)
        relative = relative_target(cost.module_path, self.prefix)
        return plain_text(relative.split(".")[0]) if relative else ""

    def forward(self) -> list[str]:
        self.own_names = dict(self.names)  # what a layer's method calls its values: its own, not the forward's
        self._name_stream()
        steps: list[Step] = []
        parameters = []
        for node in self.stage.graph.nodes:
            unit = self.unit_of.get(node.name)
            if node.op == "placeholder":
                parameters.append(node.name)
            elif node.op == "get_attr" or (unit is not None and node.name != unit.nodes[-1]):
                continue
            elif node.op == "output":
                steps.append(Step(defines=None, text=f"return {self.expressions.argument(node.args[0])}",
                                  uses=tuple(a.name for a in node.all_input_nodes), large=False))  # fmt: skip
            elif unit is not None:
                layer = attribute_path("self", unit.prefix, indexable=self._indexable)
                arguments = ", ".join(self.names[i] for i in unit.inputs)
                text = f"{self.names[unit.output]} = self.{unit.method}({arguments}, {layer})"
                steps.append(Step(defines=unit.output, text=text, uses=unit.inputs, large=True,
                                  comment=self._comment(unit.output), path=""))  # fmt: skip
            else:
                steps.append(self._step(node, self._path(node.name)))
        steps = self._copies_of_written_inputs() + steps
        signature = f"def forward(self{''.join(', ' + self.names[p] for p in parameters)}):"
        memory = self._memory(parameters, list(steps[-1].uses) if steps else [])
        return function_lines(signature, steps, parameters=set(parameters), memory=memory,
                              variable=self.names.__getitem__)  # fmt: skip

    def _copies_of_written_inputs(self) -> list[Step]:
        """A copy of each input that the stage writes in place (`written_inputs`), made first: a
        received tensor that takes a gradient is a leaf of autograd, which refuses a write, and a
        recompute or a split backward's rebuild runs the forward again on what it received, which
        must be as it came; the rank's other stages read the same batch values."""
        written = written_inputs(self.stage.graph)
        return [Step(defines=name, text=f"{self.names[name]} = {self.names[name]}.clone()  # written in place below",
                     uses=(name,), large=False)
                for name in (n.name for n in self.stage.graph.nodes if n.op == "placeholder") if name in written]

    def _name_stream(self) -> None:
        """``x`` for the residual stream between layers: each call's result replaces its input, as in nanoGPT."""
        order = {name: i for i, name in enumerate(self.nodes)}

        def position(name: str) -> int:
            unit = self.unit_of.get(name)
            return order[unit.nodes[-1]] if unit else order[name]

        def last_use(name: str) -> int:
            return max((position(u.name) for u in self.nodes[name].users), default=order[name])

        previous = None
        for unit in sorted({id(u): u for u in self.units}.values(), key=lambda u: order[u.nodes[-1]]):
            stream = self._stream(unit)
            if stream is None or last_use(stream) != position(unit.output):
                return
            if previous is None and self.nodes[stream].op != "placeholder" and stream not in self.unit_of:
                self.names[stream] = "x"
            elif previous is not None and stream != previous:
                return
            self.names[unit.output] = "x"
            previous = unit.output

    def _stream(self, unit: Unit) -> str | None:
        """The one input of a layer that is computed (not read from the batch): the residual stream."""
        computed = [i for i in unit.inputs if not (i in self.op_graph.nodes and self.op_graph.nodes[i].batch_derived)]
        return computed[0] if len(computed) == 1 else None

    def methods(self) -> list[str]:
        lines: list[str] = []
        written: set[str] = set()
        for unit in self.units:
            if unit.method in written:
                continue
            written.add(unit.method)
            lines += ["", *self._method(unit)]
        return lines

    def _method(self, unit: Unit) -> list[str]:
        saved, self.names = self.names, dict(self.own_names)
        stream = self._stream(unit)
        if stream is not None:
            self.names[stream] = "x"
        self.prefix = unit.prefix
        try:
            steps = [self._step(self.nodes[name], self._path(name)) for name in unit.nodes]
            steps.append(Step(defines=None, text=f"return {self.names[unit.output]}", uses=(unit.output,), large=False))
            holders = sorted(u.prefix for u in self.units if u.method == unit.method)
            params = ", ".join(self.names[i] for i in unit.inputs)
            memory = self._memory(list(unit.inputs), [unit.output])
            lines = function_lines(f"def {unit.method}(self, {params}, layer):", steps, parameters=set(unit.inputs),
                                   memory=memory, variable=self.names.__getitem__)  # fmt: skip
        finally:
            self.names, self.prefix = saved, ""
        doc = f'        """One layer, called for {", ".join(plain_text(h) for h in holders)}: ``layer`` is its module."""'
        return [lines[0], doc, *lines[1:]]


def stage_body(stage: StageGraph, op_graph: OpGraph, units: list[Unit],
               shapes: dict[str, tuple[tuple[int, ...], str]]) -> tuple[list[str], list[str], list[str]]:  # fmt: skip
    """The imports, the model file's own functions and classes that the code calls (by qualified
    name), and the indented methods (forward first) of a stage's class."""
    writer = _Writer(stage, op_graph, units, shapes)
    body = [*writer.forward(), *writer.methods()]
    return sorted(writer.expressions.imports), sorted(writer.expressions.from_model), body


def _import_block(imports: list[str], runtime: str, *, paths: bool) -> str:
    """The standard library, then torch, then autopart, as isort would order them."""
    standard = ["from pathlib import Path"] if paths else []
    standard += [line for line in imports if line == "import math"]
    own = [line for line in imports if line not in standard and line.split()[1].startswith("autopart")] + [runtime]
    third = ["import torch", *(line for line in imports if line not in standard and line not in own)]
    return "\n\n".join("\n".join(sorted(group)) for group in (standard, third, sorted(own)) if group) + "\n"


def _model_block(names: list[str]) -> str:
    """The model file's own functions and classes that the code calls, taken from OUT/model.py
    (the compile imported the model under a name of its own, which no rank can import)."""
    if not names:
        return ""
    lines = "".join(f"{name.replace('.', '_')} = model_attribute(MODEL_FILE, {name!r})\n" for name in names)
    return ("\n# the model file's own functions and classes that its code calls\n"
            f"MODEL_FILE = Path(__file__).resolve().parents[1] / \"model.py\"\n{lines}")


def _layer_methods_line(stage: StageGraph, units: list[Unit]) -> str:
    """The class attributes that name the layers each method computes: every call
    (``autopart.runtime.forward``'s per-layer recompute), and those whose tensors only the method
    reads (``autopart.runtime.fully_sharded``)."""
    calls: dict[str, tuple[str, ...]] = {}
    for unit in units:
        calls[unit.method] = (*calls.get(unit.method, ()), unit.prefix)
    methods = layer_methods(stage.graph, units)
    lines = []
    if calls:
        lines += ["    # the layers each method computes, given as ``layer``: full recompute checkpoints each call",
                  f"    layer_calls = {calls!r}"]
    if methods:
        lines += ["    # of those, the layers whose tensors only their method reads: each its own FSDP unit under ZeRO-3",
                  f"    layer_methods = {methods!r}"]
    return "".join(f"\n{line}" for line in lines)


def _leaf_block(stage: StageGraph, root: torch.nn.Module) -> str:
    """The LEAVES declaration of a stage that holds --leaf modules whole ("" for one that holds none)."""
    if not stage.leaves:
        return ""
    leaves = "".join(f"    {t!r}: {type(root.get_submodule(t)).__name__!r},\n" for t in stage.leaves)
    return f"""
# module path -> its class in model.py: kept whole (--leaf); built by model.py's build_model()
# on the meta device, then given this stage's weights like every other tensor
LEAVES = {{
{leaves}}}
"""


def stage_source(
    stage: StageGraph,
    *,
    stages: int,
    op_graph: OpGraph,
    metas: dict[str, torch.Tensor],
    header: str,
    units: list[Unit],
    shapes: dict[str, tuple[tuple[int, ...], str]],
) -> str:
    """Python source of one stage: a module docstring, the tensor declarations, the forward and layer code."""
    imports, from_model, body_lines = stage_body(stage, op_graph, units, shapes)
    class_name = f"Stage{stage.index}"

    def declarations(names: tuple[str, ...]) -> str:
        lines = []
        for target in names:
            tensor = metas[target]
            dtype = str(tensor.dtype).removeprefix("torch.")
            lines.append(f"    {target!r}: ({tuple(tensor.shape)!r}, torch.{dtype}),")
        return "".join(line + "\n" for line in lines)

    declare_leaves = (
        "\n        declare_leaves(self, LEAVES, Path(__file__).resolve().parents[1] / \"model.py\")" if stage.leaves else ""
    )

    def signature(names: tuple[str, ...]) -> str:
        return ", ".join(repr(n) for n in names) + ("," if len(names) == 1 else "")

    body = "\n".join(body_lines)
    constant_block = (
        f"""# tensors that the model makes in forward, captured as constants; loaded from weights/
CONSTANTS = {{
{declarations(stage.constants)}}}
"""
        if stage.constants
        else ""
    )
    root = op_graph.graph.module
    frozen = tuple(name for name in stage.parameters if not root.get_parameter(name).requires_grad)
    frozen_block = (f"# the model's parameters that do not train (requires_grad=False): no gradient, no optimizer step\n"
                    f"FROZEN = ({signature(frozen)})\n") if frozen else ""
    leaf_block = _leaf_block(stage, root)
    updated = (f"\n    updated_buffers = ({signature(updated_buffers(stage, root))})  # written by forward: moved once a step "
               "(autopart.runtime.buffer_updates)")
    layers = _layer_methods_line(stage, units)
    named = ["declare_leaves"] * bool(stage.leaves) + ["declare_tensors"] + ["model_attribute"] * bool(from_model)
    runtime = f"from autopart.runtime.stage import {', '.join(named)}"
    import_lines = _import_block(imports, runtime, paths=bool(stage.leaves or from_model)) + _model_block(from_model)
    return f'''{header}
{import_lines}

# name in the original model -> (shape, dtype); values from weights/, train.py --weights CKPT, or
# (a model built on the meta device) the model's initialisers, run on this rank
PARAMETERS = {{
{declarations(stage.parameters)}}}
BUFFERS = {{
{declarations(stage.buffers)}}}
{frozen_block}{constant_block}{leaf_block}

class {class_name}(torch.nn.Module):
    """Stage {stage.index} of {stages}."""

    inputs = ({signature(stage.inputs)})  # {"the first stage: none" if stage.index == 0 else f"received from stage {stage.index - 1}"}
    batch_inputs = ({signature(stage.batch_inputs)})  # read from the batch
    outputs = ({signature(stage.outputs)})  # {"the loss" if stage.index == stages - 1 else f"sent to stage {stage.index + 1}"}{updated}{layers}

    def __init__(self):
        super().__init__()
        declare_tensors(self, PARAMETERS, BUFFERS{", CONSTANTS" if stage.constants else ""}{", frozen=FROZEN" if frozen else ""}){declare_leaves}

{body}


STAGE = {class_name}
'''
