"""Capture with ``torch.export`` and bring the result into the form every later pass reads.

``export_training_graph(model, loss_fn, inputs, target) -> fx.GraphModule``.

``torch.export`` succeeds where fx symbolic tracing cannot: Python control flow on shapes and
asserts on input sizes run on concrete sizes (the graph is exported at the microbatch size, so
its shapes are those the stages run). Its graph is ATen-level and lifts parameters, buffers and
constants into placeholders; here they go back to ``get_attr`` nodes under the original
parameter names, the placeholders become the model's inputs (named as in ``forward``) then the
target, and the output becomes the loss itself. Two things of the export machine are removed:
``aten._assert_tensor_metadata`` checks (they pin the device the graph was exported on) and
device constants, which become the device of the first input so that stages run on any device.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from autopart.ir.errors import CaptureError

__all__ = ["export_training_graph"]

_PREFIX = "model."  # the wrapper's name for the user's model
_DROPPED = (torch.ops.aten._assert_tensor_metadata.default,)


class _Training(nn.Module):
    """Model and loss as one module, so that one export holds both."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None, inputs: int):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.inputs = inputs

    def forward(self, *args: Any) -> torch.Tensor:
        output = self.model(*args[: self.inputs])
        return output if self.loss_fn is None else self.loss_fn(output, args[self.inputs])


def _input_names(model: nn.Module, count: int, target_name: str | None) -> list[str]:
    """The names of ``forward``'s parameters, as fx would give them; ``input_<i>`` past them."""
    try:
        parameters = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        parameters = []
    names = [parameters[i] if i < len(parameters) else f"input_{i}" for i in range(count)]
    if target_name is not None:
        names = [n if n != target_name else f"{n}_input" for n in names] + [target_name]
    return names


def export_training_graph(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    inputs: tuple[torch.Tensor, ...],
    target: Any,
    *,
    target_name: str,
) -> fx.GraphModule:
    """Export model and loss at the shapes of ``inputs`` and convert to autopart's graph form;
    the target's placeholder is called ``target_name``."""
    args = (*inputs, target) if loss_fn is not None else tuple(inputs)
    # export reads one tensor passed twice (a target that is the input tokens) as one input: copy each
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)  # export logs graphs and guards on failure; the caller says it in one line
    try:  # ... and prints the partial graph: kept off the terminal too
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            program = torch.export.export(_Training(model, loss_fn, len(inputs)), args, strict=False)
    finally:
        logging.disable(previous)
    return _convert(program, model, _input_names(model, len(inputs), target_name if loss_fn is not None else None))


def _strip(fqn: str) -> str:
    return fqn.removeprefix(_PREFIX)


def _convert(program: ExportedProgram, model: nn.Module, input_names: list[str]) -> fx.GraphModule:
    signature = program.graph_signature
    mutated = [s for s in signature.output_specs if s.kind is not OutputKind.USER_OUTPUT]
    if mutated:
        raise CaptureError(
            f"the model updates {mutated[0].target or 'an input'} in place in forward (running statistics, "
            "caches); torch.export captures that as an extra output, which autopart cannot train; "
            "remove the in-place update (e.g. BatchNorm(track_running_stats=False))"
        )
    attributes, lifted, users = _lifted_inputs(program, model, input_names)

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    source = program.graph_module.graph
    placeholders = {n.name: n for n in source.nodes if n.op == "placeholder"}
    for name, new_name in zip(users, input_names):
        env[placeholders[name]] = graph.placeholder(new_name)
    device_node: fx.Node | None = None
    first_input = env[placeholders[users[0]]] if users else None

    def device_of_inputs() -> fx.Node:
        nonlocal device_node
        if device_node is None:
            device_node = graph.call_function(getattr, (first_input, "device"))
        return device_node

    def mapped(value: Any) -> Any:
        if isinstance(value, fx.Node):
            if value not in env:  # a lifted tensor: read where it is first used, as fx would
                env[value] = graph.get_attr(lifted[value.name])
            return env[value]
        if isinstance(value, torch.device) and first_input is not None:
            return device_of_inputs()
        if isinstance(value, (list, tuple)):
            return type(value)(mapped(v) for v in value)
        if isinstance(value, dict):
            return {k: mapped(v) for k, v in value.items()}
        return value

    for node in source.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            (loss,) = node.args[0]
            graph.output(mapped(loss))
            continue
        if node.op == "call_function" and node.target in _DROPPED:
            continue
        if node.op == "get_attr":  # a higher-order op's subgraph (true_graph_0 of a torch.cond)
            raise CaptureError(_subgraph_refusal(node))
        if node.op != "call_function":
            raise CaptureError(
                f"torch.export produced a {node.op} node ({node.target}), which autopart cannot split into "
                "stages yet; try --capture fx"
            )
        new = graph.create_node("call_function", node.target, mapped(node.args), mapped(node.kwargs), name=node.name)
        new.meta["nn_module_stack"] = {
            key: (_strip(path) if path != "model" else "", kind)
            for key, (path, kind) in node.meta.get("nn_module_stack", {}).items()
        }
        if "stack_trace" in node.meta:
            new.meta["stack_trace"] = node.meta["stack_trace"]
        env[node] = new
    graph.eliminate_dead_code()
    graph.lint()
    return fx.GraphModule(attributes, graph, class_name="TrainingGraph")


_CONTROL_FLOW = {"cond": ("torch.cond", "compute both branches and choose with torch.where"),
                 "while_loop": ("torch.while_loop", "loop a number of times that Python knows")}
"""Higher-order ops of control flow on tensor values: what the model calls, and what to write instead."""


def _subgraph_refusal(node: fx.Node) -> str:
    """Why a subgraph of the export (a ``get_attr`` of a GraphModule that a higher-order op
    runs) cannot be split into stages, named by what in the model made it, and what to write instead."""
    users = [user for user in node.users if user.op == "call_function"]
    op = getattr(users[0].target, "__name__", str(users[0].target)) if users else str(node.target)
    where = _model_line(users[0]) if users else ""
    if op in _CONTROL_FLOW:
        called, instead = _CONTROL_FLOW[op]
        return (f"the model calls {called}{where}, control flow on tensor values that torch.export keeps as "
                f"subgraphs and autopart cannot split into stages (nor torch.fx trace); {instead} instead")
    if op == "wrap_with_set_grad_enabled":
        return ("torch.export keeps a part of forward that runs under torch.no_grad() or torch.enable_grad() (as a "
                "torch.utils.checkpoint with use_reentrant=True runs its function) as a subgraph, which autopart cannot "
                "split into stages; checkpoint with use_reentrant=False (or leave it to --recompute), and .detach() "
                "what needs no gradient")
    if op == "wrap_with_autocast":
        return ("torch.export keeps a torch.autocast region of forward as a subgraph, which autopart cannot split into "
                "stages; remove the autocast and compile with --dtype bf16-autocast")
    return (f"torch.export keeps {op}{where} as a subgraph ({node.target}), which autopart cannot split into stages; "
            "rewrite that part of forward without it, or try --capture fx")


def _model_line(node: fx.Node) -> str:
    """' at model.py:14': the innermost frame of the node's stack that is neither torch's nor autopart's."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    ours = tuple(f"{folder}{os.sep}" for folder in (Path(torch.__file__).parent, Path(__file__).resolve().parents[1]))
    theirs = [(file, line) for file, line in frames if not file.startswith(("<", *ours))]
    return f" at {Path(theirs[-1][0]).name}:{theirs[-1][1]}" if theirs else ""


def _lifted_inputs(program: ExportedProgram, model: nn.Module, input_names: list[str]
                   ) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """What torch.export lifted into inputs, put back as module state: the new module's tensors
    by get_attr target, each lifted placeholder's target, and the user inputs' placeholders."""
    signature = program.graph_signature
    named: dict[str, Any] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    attributes: dict[str, Any] = {}  # get_attr target -> tensor, the new module's state
    lifted: dict[str, str] = {}  # placeholder name -> get_attr target
    users: list[str] = []
    for spec in signature.input_specs:
        name = spec.arg.name
        if spec.kind is InputKind.USER_INPUT:
            users.append(name)
            continue
        target = _strip(spec.target)
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            attributes[target] = named[target]
        else:  # a tensor constant made in forward, e.g. torch.tensor(...) in a module
            attributes[target] = program.constants[spec.target]
        lifted[name] = target
    if len(users) != len(input_names):
        raise CaptureError(f"torch.export gave {len(users)} inputs where {len(input_names)} were expected; report this model")
    return attributes, lifted, users

