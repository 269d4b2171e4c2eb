"""Which values of the training graph need a gradient: those with a trainable parameter upstream.

A value that no trainable parameter feeds (the batch, a buffer, a frozen embedding's rows, what
frozen lower layers make of them, an integer index) takes no gradient in training: autograd
records nothing for the ops that make it, and their backward never runs. This is the one fact
that the annotation costs backward by (`autopart.passes.annotate`: such an op has no
input-gradient half, saves nothing, and without a trainable parameter of its own no backward at
all), that the plan records for the tensors crossing a pipeline boundary (`StagePlan.no_grad_inputs`)
and that the runtime follows: a received tensor requires grad only where it needs one, and no
gradient goes back for one that does not (`autopart.runtime.executor`).
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopart.passes.weight_seeds import OpSeeds
from cost_models import OpTimes

__all__ = ["GradientFlow", "needed_backward", "took_gradient", "trainable_parameters"]

_DETACHING = {"detach", "detach_", torch.Tensor.detach, torch.detach}
"""Ops whose output never takes a gradient whatever they read."""

_VIEWS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand", "expand_as", "select", "narrow",
          "unsqueeze", "squeeze", "flatten", "unflatten", "t", "contiguous", "split", "chunk", "unbind", "diagonal",
          "movedim", "swapaxes", "as_strided", "getitem", "__getitem__"}
"""Ops (by name) whose output may share its first argument's storage: a write into it writes that too."""


def trainable_parameters(module: torch.nn.Module) -> set[str]:
    """The names (tied ones under each of their names) of the parameters that train."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}


class GradientFlow:
    """Visits the nodes of a graph in order and says of each whether its value needs a gradient.

    ``trainable``: the names of the parameters that train (`trainable_parameters`), as ``get_attr``
    targets name them; a ``--leaf`` module's node needs one where the module holds one of them.
    ``seen``: the nodes whose value took a gradient in a run of the whole graph (`took_gradient`),
    which need one whatever the rule says. The rule follows what each op reads and the writes it
    can see; autograd follows every write through any alias (a frozen embedding's rows with a
    trained prompt written into a slice of them, under torch.export's ``slice.Tensor`` and
    ``copy_``; a view taken before its base is written), and a gradient that one of the two
    misses would be dropped in silence, where one it adds costs only a backward."""

    def __init__(self, trainable: set[str], seen: set[str] | frozenset[str] = frozenset()):
        self.trainable = trainable
        self.seen = seen
        self.needs: dict[str, bool] = {}

    def visit(self, node: fx.Node, value: Any = None) -> bool:
        """Take ``node`` in (after every node it reads); ``value``: what it made, where known (a
        value with no floating tensor in it takes no gradient, a size or an index)."""
        if node.op == "placeholder":
            needs = False
        elif node.op == "get_attr":
            needs = node.target in self.trainable
        elif node.target in _DETACHING or not _floating(value):
            needs = False
        elif node.op == "call_module":
            prefix = f"{node.target}."
            needs = self._reads_gradient(node) or any(name.startswith(prefix) for name in self.trainable)
        else:
            needs = self._reads_gradient(node)
        self.needs[node.name] = needs
        written = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if needs and written is not None and _writes(node):  # ``buf[i] = y``, ``v.add_(y)``: buf now takes y's
            self._written(written)
        return needs or node.name in self.seen  # autograd's verdict on the value itself, not passed on to
        # its readers: one that read it before a later write took none, and one after is seen itself

    def _written(self, node: fx.Node) -> None:
        """``node``'s value, and the values it is a view of, need a gradient from here on (their
        readers after the write take them so; an op that read them before did not)."""
        self.needs[node.name] = True
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if source is not None and _name(node) in _VIEWS:
            self._written(source)

    def _reads_gradient(self, node: fx.Node) -> bool:
        return any(self.needs[a.name] for a in node.all_input_nodes)

    def input_gradient(self, node: fx.Node, parameters: set[str]) -> bool:
        """Whether any value ``node`` reads, besides the ``parameters`` themselves (whose gradients
        are the weight-gradient half), needs a gradient: else the node's input-gradient half never runs."""
        return any(self.needs[a.name] or a.name in self.seen for a in node.all_input_nodes
                   if not (a.op == "get_attr" and a.target in parameters))


def took_gradient(values: dict[str, Any]) -> set[str]:
    """The nodes whose value (a node's output, by name, as a run of the whole graph left it: after
    every in-place write of the run) holds a tensor that requires grad."""
    return {name for name, value in values.items()
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value))}


def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def _writes(node: fx.Node) -> bool:
    """An op that writes its first argument: ``operator.setitem``, an ATen overload whose schema
    says so (torch.export), or an in-place method or function (``x.add_``)."""
    if node.target is operator.setitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    name = _name(node)
    return node.op in ("call_function", "call_method") and name.endswith("_") and not name.endswith("__")


def _floating(value: Any) -> bool:
    if value is None:  # not known: as if it were
        return True
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               for t in pytree.tree_leaves(value))


def needed_backward(backward: tuple[Any, Any], times: OpTimes, seeds: OpSeeds, *, input_gradient: bool,
                    needs: bool) -> tuple[tuple[Any, Any], OpTimes, OpSeeds]:
    """An op's measured backward kernels (input-gradient, weight-gradient), times and seeds, less
    what training never runs: without an ``input_gradient`` (`GradientFlow.input_gradient`) the
    input-gradient half and the seeds it keeps for W; where its value ``needs`` no gradient, all.
    (An op that reads one value needing a gradient and one that does not is charged both.)"""
    into_inputs, into_weights = backward
    if not needs:
        return ((), ()), OpTimes(forward_s=times.forward_s), OpSeeds()
    if not input_gradient:
        return ((), into_weights), replace(times, backward_input_s=0.0), OpSeeds()
    return backward, times, seeds
