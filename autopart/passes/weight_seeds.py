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
gradient (there `backward_input` keeps the whole graph instead, and no seeds).

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

from autopart.runtime.backward import backward_input

__all__ = ["OpSeeds", "measure_seeds", "shared_seeds"]


@dataclass(frozen=True)
class OpSeeds:
    nbytes: int = 0  # what I keeps for W, each storage once
    of_output: bool = False  # they are the op's output's gradient (one storage)
    passes: tuple[int, ...] = ()  # positions in ``node.all_input_nodes`` whose gradient is the output's itself
    takes: tuple[int, ...] = ()  # positions in ``node.all_input_nodes`` that get a gradient at all (not a type_as's dtype)


def measure_seeds(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                  weights: Sequence[torch.Tensor], input_grads: dict[int, torch.Tensor | None],
                  input_values: Sequence[object]) -> OpSeeds:
    """The seeds of an op whose ``outputs`` (made from the leaves ``inputs`` and ``weights``) get
    ``grads``. ``input_grads``: per id of an input's original value, the gradient a backward gave
    it; ``input_values``: the values of ``node.all_input_nodes``, in order."""
    output_storage = _storage(grads[0]) if len(grads) == 1 else None
    found = [input_grads.get(id(value)) for value in input_values]
    takes = tuple(i for i, g in enumerate(found) if g is not None)
    passes = tuple(i for i in takes if output_storage is not None and _storage(found[i]) == output_storage)
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
                reader.all_input_nodes[i] is node for i in theirs.passes):
            shared[node.name] = reader.name
    return shared


def _sends_gradient(user: fx.Node, node: fx.Node, seeds: dict[str, OpSeeds]) -> bool:
    measured = seeds.get(user.name)
    if measured is None:  # not an op (the graph's output): as if it did
        return True
    return any(user.all_input_nodes[i] is node for i in measured.takes)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata  # fake and meta tensors have one too
