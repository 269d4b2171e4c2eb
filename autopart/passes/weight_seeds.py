"""What a split backward's input half (I) keeps for its weight half (W), per op.

`autopart.runtime.backward.backward_input` keeps the incoming gradient of every *frontier* node
(one on the path to the stage's inputs with an edge towards parameters alone: a linear layer's
matrix product, a bias add, a norm's affine), and W restarts autograd from them. These seeds live
from a microbatch's I to its W, beside its activations, for every microbatch the zero-bubble
schedules hold back between the two (`autopart.predict.in_flight.weight_pending`): per layer about
one more copy of each linear layer's and each norm's output, and on the last stage the logits'
gradient.

They are measured here by running the runtime's own I on the op, so that what the memory model
counts is what the runtime keeps, whatever the op is (a leaf module's internal frontier too).
A stage's frontier is its ops' frontiers together: an op's outputs lead to the stage's outputs,
and its float inputs to the stage's inputs, in every stage but the first, whose inputs take no
gradient (there `backward_input` keeps the whole graph instead, and no seeds); a value made from
parameters alone counts as a parameter (`ParameterValues`). Not counted: an in-place op on a
weight, which annotate runs without autograd.

The count per stage takes in the microbatch whose I runs (`weight_pending`), whose head seed on
the last stage is, in fp32, the storage of the loss input's gradient that
`autopart.passes.front.loss_working_bytes` counts too: one logits-sized tensor counted twice
there, on the safe side.

One gradient can be two ops' seeds: a bias add (`autopart.passes.rewrite.separate_biases`) hands
the gradient it keeps to its linear unchanged, which keeps it too (a view of it). Each op says
whether its seeds are its output's gradient and which of its inputs get that gradient itself, and
`shared_seeds` finds the ops whose seeds their one reader keeps already.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopart.runtime.backward import backward_input

__all__ = ["OpSeeds", "ParameterValues", "arg_nodes", "arg_places", "op_seeds", "shared_seeds"]


@dataclass(frozen=True)
class OpSeeds:
    nbytes: int = 0  # what I keeps for W, each storage once
    of_output: bool = False  # they are the op's output's gradient (one storage)
    passes: tuple[int, ...] = ()  # places in ``arg_nodes(node)`` whose gradient is the output's itself
    takes: tuple[int, ...] = ()  # places in ``arg_nodes(node)`` that get a gradient at all (not a type_as's dtype)


def arg_nodes(node: fx.Node) -> list[fx.Node]:
    """The values ``node`` reads, once per place it reads them (``all_input_nodes`` lists each once)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def arg_places(node: fx.Node) -> tuple[bool, ...]:
    """Per argument leaf of ``node``, whether a node makes it: two ops whose cost keys agree (which
    show a number by its value) may still read a number from a node in one and a constant in the
    other, and `OpSeeds`' places index ``arg_nodes``; measurements are shared only where these agree."""
    found: list[bool] = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.append(isinstance(a, fx.Node)))
    return tuple(found)


_PLAIN = (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format, torch.SymInt,
          type(None))
"""What a value that carries no gradient is made of (an object pytree cannot look into may hold a tensor)."""


class ParameterValues:
    """Which values are made from parameters alone (a tied head's ``wte.weight.T``, Gemma's
    ``1 + w``): autograd reaches only parameters past one, so an op that reads one has a frontier
    there, as at a parameter, though the op reads no parameter itself."""

    def __init__(self, parameter_names: set[str]):
        self.names = parameter_names
        self.static: dict[str, bool] = {}  # carries a gradient to parameters only, if any
        self.weighty: dict[str, bool] = {}  # and from a parameter

    def visit(self, node: fx.Node, value: object = None) -> tuple[int, ...]:
        """Take ``node`` in (in graph order); the places in ``arg_nodes(node)`` of the values it reads
        that ops made from parameters alone. ``value``: what the node made, where known: one that
        holds no tensor (a size read off an activation, as ``q.expand(x.size(0), -1, -1)`` reads
        one) carries no gradient, so it keeps nothing that reads it from being made of parameters."""
        reads = arg_nodes(node)
        tensorless = value is not None and all(isinstance(v, _PLAIN) for v in pytree.tree_leaves(value))
        if node.op == "get_attr":
            static, weighty = True, node.target in self.names
        elif node.op in ("call_function", "call_method") and tensorless:
            static, weighty = True, False
        elif node.op in ("call_function", "call_method"):
            static = bool(reads) and all(self.static[a.name] for a in reads)
            weighty = static and any(self.weighty[a.name] for a in reads)
        else:  # the batch, a leaf module's output, the graph's output
            static = weighty = False
        self.static[node.name], self.weighty[node.name] = static, weighty
        return tuple(i for i, a in enumerate(reads) if self.weighty[a.name] and a.op != "get_attr")


def op_seeds(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
             weights: Sequence[torch.Tensor], input_grads: dict[int, torch.Tensor | None],
             original_of: dict[int, object], arg_values: Sequence[object], made_from_weights: tuple[int, ...]) -> OpSeeds:
    """The seeds of an op whose ``outputs`` (made from the leaves ``inputs`` and ``weights``) get
    ``grads``. ``input_grads``: per id of an input's original value, the gradient a backward gave
    it; ``original_of``: per id of a leaf, its original value; ``arg_values``: the values of
    ``arg_nodes(node)``, of which those at ``made_from_weights`` count as weights (`ParameterValues`)."""
    output_storage = _storage(grads[0]) if len(grads) == 1 else None
    found = [input_grads.get(id(value)) for value in arg_values]
    takes = tuple(i for i, g in enumerate(found) if g is not None)
    passes = tuple(i for i in takes if output_storage is not None and _storage(found[i]) == output_storage)
    derived = {id(v) for i in made_from_weights for v in pytree.tree_leaves(arg_values[i])}  # a tuple's items too
    moved = [leaf for leaf in inputs if id(original_of.get(id(leaf))) in derived]
    inputs = [leaf for leaf in inputs if id(original_of.get(id(leaf))) not in derived]
    weights = [*weights, *moved]
    if not (outputs and inputs and weights):
        return OpSeeds(passes=passes, takes=takes)
    _, pending = backward_input(outputs, grads, inputs, weights)
    kept = {_storage(g): g.untyped_storage().nbytes() for group in pending.groups for seeds in group.kept.values()
            for g in seeds if g is not None}
    return OpSeeds(nbytes=sum(kept.values()), of_output=output_storage is not None and set(kept) == {output_storage},
                   passes=passes, takes=takes)


def shared_seeds(graph: fx.Graph, seeds: dict[str, OpSeeds]) -> dict[str, str]:
    """Per op whose seeds are its output's gradient and whose one reader that sends it a gradient
    keeps that same gradient (it passes its own output's gradient through to it, and keeps that),
    the reader. A reader that sends it none (``b.type_as(x)`` reads x's dtype alone) does not count."""
    shared = {}
    for node in graph.nodes:
        mine = seeds.get(node.name)
        if mine is None or not mine.nbytes or not mine.of_output:
            continue
        readers = [user for user in node.users if _sends_gradient(user, node, seeds)]
        if len(readers) != 1:
            continue
        reader = readers[0]
        theirs = seeds.get(reader.name)
        if theirs is not None and theirs.nbytes and theirs.of_output and any(
                arg_nodes(reader)[i] is node for i in theirs.passes):
            shared[node.name] = reader.name
    return shared


def _sends_gradient(user: fx.Node, node: fx.Node, seeds: dict[str, OpSeeds]) -> bool:
    measured = seeds.get(user.name)
    if measured is None:  # not an op (the graph's output): as if it did
        return True
    reads = arg_nodes(user)
    return any(reads[i] is node for i in measured.takes)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata  # fake and meta tensors have one too
