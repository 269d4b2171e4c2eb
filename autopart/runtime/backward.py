"""The backward of one stage and microbatch: whole (B), or split into input gradients (I) and
weight gradients (W) for the zero-bubble schedules.

I runs autograd from the stage's outputs to its inputs only. Autograd computes a node's
gradient outputs only along edges that lead to what was asked for, so a linear layer's I does
``grad_out @ W`` and skips ``grad_out.T @ x``. While it runs, a pre-hook keeps the incoming
gradient of every *frontier* node: a node on the path to the inputs that also has an edge into
the part of the graph that leads only to parameters (a linear layer's ``AddmmBackward``).
W restarts autograd at those nodes with the kept gradients and asks for the parameters only,
so the frontier nodes now compute just their weight-gradient outputs. Nothing of I is computed
again, and I plus W costs what B costs (``tests/test_split_backward.py`` counts the FLOPs).

This is torch.distributed.pipelining's ``stage_backward_input``/``stage_backward_weight``
(``_backward.py``), with two of its gaps closed: parameters are grouped with a real union-find
(a parameter reaching two existing groups merges them instead of being counted twice), and a
stage whose outputs do not all depend on its inputs (the first stage, which receives no float
tensor) is not silently left without weight gradients: there I does nothing it cannot do
exactly, and W runs the whole backward restricted to the parameters.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["PendingWeights", "backward_full", "backward_input", "backward_phase", "backward_weight"]

_PHASE = "whole"


def backward_phase() -> str:
    """What the backward running now computes: ``"input"`` (I: the inputs' gradients only),
    ``"weight"`` (W from the frontier nodes: the parameters' only) or ``"whole"``. Autograd runs a
    frontier node in I and again in W and cannot tell it which gradients each run wants; a custom
    node that computes both at once (``tp.gathered_linear``: a collective for each) reads this to
    compute one set each time. A plain global, not a context variable: autograd runs a CUDA
    graph's nodes on its device threads, while the caller waits."""
    return _PHASE


@contextmanager
def _phase(name: str) -> Iterator[None]:
    global _PHASE
    before, _PHASE = _PHASE, name
    try:
        yield
    finally:
        _PHASE = before


@dataclass(kw_only=True)
class _Group:
    """Parameters whose weight gradients flow through the same frontier nodes."""

    frontier: list[Node]
    parameters: list[torch.Tensor]
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)  # grad_outputs seen in I


@dataclass(kw_only=True)
class PendingWeights:
    """What I leaves for W: the frontier groups, or the whole graph when it had to keep it."""

    groups: list[_Group] = field(default_factory=list)
    whole: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None  # outputs, grads, params


def backward_full(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """B: accumulate every parameter's gradient and return the inputs' gradients."""
    torch.autograd.backward(list(outputs), list(grads))
    return [t.grad for t in inputs]


def _node(tensor: torch.Tensor) -> Node | None:
    """The autograd node of a tensor; for a leaf, its gradient accumulator."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if not tensor.requires_grad:
        return None
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots``, with the nodes that have an edge into it."""
    parents: dict[Node, list[Node]] = {root: [] for root in roots}
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _ancestors(starts: list[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes above ``starts`` (themselves included) not passing through ``stop``, and the stop nodes met."""
    seen, met = set(starts), set()
    queue = deque(starts)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, met


def _groups(parents: dict[Node, list[Node]], on_input_path: set[Node], parameters: list[torch.Tensor]) -> list[_Group]:
    """Group the parameters that share frontier nodes (union-find over the frontier)."""
    owner: dict[Node, int] = {}  # frontier node -> a parameter index
    root = list(range(len(parameters)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    frontier_of: dict[int, set[Node]] = {}
    for index, parameter in enumerate(parameters):
        _, met = _ancestors([_node(parameter)], parents, on_input_path)  # type: ignore[list-item]
        frontier_of[index] = met
        for node in met:
            if node in owner:
                root[find(index)] = find(owner[node])
            else:
                owner[node] = index
    merged: dict[int, _Group] = {}
    for index, parameter in enumerate(parameters):
        group = merged.setdefault(find(index), _Group(frontier=[], parameters=[]))
        group.parameters.append(parameter)
        group.frontier.extend(n for n in frontier_of[index] if n not in group.frontier)
    return list(merged.values())


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    parameters: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], PendingWeights]:
    """I: the gradients of ``inputs`` (None where an input does not reach the outputs), and
    what `backward_weight` needs to add the parameters' gradients later."""
    outputs, grads = list(outputs), list(grads)
    roots = [n for n in map(_node, outputs) if n is not None]
    parents = _parents(roots)
    input_nodes = [n for n in map(_node, inputs) if n is not None and n in parents]
    on_input_path, _ = _ancestors(input_nodes, parents, set())
    reached = [p for p in parameters if p.requires_grad and _node(p) in parents]
    every_output_on_input_path = all(root in on_input_path for root in roots)
    groups = _groups(parents, on_input_path, reached) if every_output_on_input_path else []
    if not every_output_on_input_path or not all(group.frontier for group in groups):
        # An output that does not depend on any input (all of them, on the first stage) holds
        # weight gradients that no frontier node sees: keep the whole graph for W instead.
        with _phase("input"):
            found = _grad(outputs, grads, inputs, retain_graph=True)
        return found, PendingWeights(whole=(outputs, grads, reached))
    handles = []
    try:
        for group in groups:
            for node in group.frontier:
                handles.append(node.register_prehook(_keeper(group.kept, node)))
        with _phase("input"):
            found = _grad(outputs, grads, inputs, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return found, PendingWeights(groups=groups)


def _keeper(kept: dict[Node, tuple[torch.Tensor | None, ...]], node: Node):
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        kept[node] = tuple(grad_outputs)

    return hook


def _grad(
    outputs: list[torch.Tensor], grads: list[torch.Tensor], inputs: Sequence[torch.Tensor], *, retain_graph: bool
) -> list[torch.Tensor | None]:
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted:
        return [None] * len(inputs)
    found = iter(torch.autograd.grad(outputs, wanted, grads, retain_graph=retain_graph, allow_unused=True))
    return [next(found) if t.requires_grad else None for t in inputs]


def backward_weight(pending: PendingWeights) -> None:
    """W: accumulate the parameters' gradients that I left pending."""
    if pending.whole is not None:
        outputs, grads, parameters = pending.whole
        pending.whole = None
        if parameters:
            torch.autograd.backward(outputs, grads, inputs=parameters)
        return
    for group in pending.groups:
        starts, seeds = [], []
        for node in group.frontier:
            for position, grad in enumerate(group.kept.get(node, ())):
                if grad is not None:
                    starts.append(GradientEdge(node, position))
                    seeds.append(grad)
        if not starts:
            continue  # the gradient never reached this group: its parameters get none, as in B
        handles = []
        if len(group.frontier) > 1:
            # A frontier node below another one would get the upper node's gradient a second
            # time: hold every frontier node's incoming gradient at what I saw.
            for node in group.frontier:
                kept = group.kept.get(node)
                if kept is not None:
                    handles.append(node.register_prehook(lambda _, kept=kept: kept))
        try:
            targets = [GradientEdge(_node(p), 0) for p in group.parameters]  # type: ignore[arg-type]
            with _phase("weight"):  # a frontier node's input gradients were I's: below it, only other starts
                found = torch.autograd.grad(starts, targets, seeds, retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for parameter, grad in zip(group.parameters, found):
            if grad is None:
                continue
            if parameter.grad is None:
                # a copy, as AccumulateGrad makes: autograd may hand two parameters one tensor
                parameter.grad = grad.clone(memory_format=torch.contiguous_format)
            else:
                parameter.grad += grad
    pending.groups = []
