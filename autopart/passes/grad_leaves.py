"""An op's arguments as fresh autograd leaves, so that its forward and its input and weight
gradients can be run and timed alone (`autopart.passes.annotate`, `autopart.profiling.profile`)."""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["grad_ready", "leaves_for_grad"]


def leaves_for_grad(args: tuple, kwargs: dict, parameters: set[int], *, clone: bool = False,
                    master: torch.dtype | None = None,
                    frozen: Set[int] = frozenset()) -> tuple[tuple, dict, list[torch.Tensor], list[torch.Tensor]]:
    """The arguments as fresh autograd leaves: (args, kwargs, input leaves, weight leaves).

    ``clone=True`` copies every tensor first, so that timing an in-place op many times never
    changes the values that later nodes read. ``master``: the dtype of the master weights that
    working copies are cast from (``bf16``); the weight leaves are then in it and the op gets
    their casts, made here, so that the forward has no cast and the weight gradient is cast back
    into the master's dtype, as the runtime's one cast per step does in every microbatch's backward.
    ``frozen``: the parameters (by id) that do not train, which get no gradient, as in training.
    """
    inputs: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []

    def ready(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        copy = value.detach().clone() if clone else value
        if id(value) in frozen:
            return copy.detach()
        return grad_ready(copy, {id(copy)} if id(value) in parameters else set(), inputs, weights, master)

    args, kwargs = pytree.tree_map(ready, (args, kwargs))
    return args, kwargs, inputs, weights


def grad_ready(value: Any, parameters: set[int], into: list[torch.Tensor], weights: list[torch.Tensor],
               master: torch.dtype | None = None) -> Any:
    """``value`` as a leaf that requires grad, listed in ``weights`` when it is one of the
    ``parameters`` (by id), else in ``into``; see `leaves_for_grad` for ``master``."""
    if not isinstance(value, torch.Tensor):
        return value
    leaf = value.detach()
    if not leaf.is_floating_point():
        return leaf
    if id(value) not in parameters:
        into.append(leaf.requires_grad_(True))
        return leaf
    if master is None or leaf.dtype == master:
        weights.append(leaf.requires_grad_(True))
        return leaf
    held = leaf.to(master).requires_grad_(True)
    weights.append(held)
    return held.to(leaf.dtype)
