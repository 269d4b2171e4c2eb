"""A model with many identical layers, seen through a copy that keeps two of them.

The search asks for the chain's costs at every micro-batch size and tensor-parallel degree it
visits, and each answer is a capture and an annotation of the whole model: minutes for an
80-layer model, of which all but two layers repeat work already done. ``repeated_layers`` finds
the longest ``nn.ModuleList`` of layers alike (the same modules, the same parameter shapes);
``shallow_module`` is the model with that list cut to its first ``kept`` layers, sharing every
weight with the original (nothing is copied or allocated). Its chain, laid out to full depth by
``autopart.solve.repeat``, costs what the full model's chain costs, block for block; the
planner still captures the full model once, for the plan it emits, and checks there that the
chains agree. That capture's annotation is read off a copy of three layers where the graphs
are alike (``autopart.passes.repeat_annotation``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

__all__ = ["RepeatedLayers", "repeated_layers", "shallow_module", "SHALLOW_FROM_LAYERS", "KEPT_LAYERS"]

SHALLOW_FROM_LAYERS = 8
"""A list of fewer layers than this is captured whole: the saving would not pay for the check."""
KEPT_LAYERS = 2
"""Layers the shallow copy keeps: the first, whose input is the embedding's, and one fed by a layer."""


@dataclass(frozen=True, kw_only=True)
class RepeatedLayers:
    """Where the model's repeated layers are (``"h"``, ``"model.layers"``) and how many it has."""

    path: str
    count: int


def repeated_layers(module: nn.Module) -> RepeatedLayers | None:
    """The longest ``nn.ModuleList`` below ``module`` of at least ``SHALLOW_FROM_LAYERS`` layers
    that print alike and hold parameters and buffers of the same names, shapes and dtypes."""
    found = None
    for path, child in module.named_modules():
        if not path or not isinstance(child, nn.ModuleList) or len(child) < SHALLOW_FROM_LAYERS:
            continue
        first = _structure(child[0])
        if all(_structure(layer) == first for layer in child) and (found is None or len(child) > found.count):
            found = RepeatedLayers(path=path, count=len(child))
    return found


def _structure(layer: nn.Module) -> tuple:
    tensors = (*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False))
    return repr(layer), tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in tensors)


def shallow_module(module: nn.Module, layers: RepeatedLayers, kept: int = KEPT_LAYERS) -> nn.Module:
    """``module`` with its repeated layers cut to the first ``kept``; the original is untouched
    (each module on the path to the list is a shallow copy with its own child table)."""
    root = _with_own_children(module)
    parent = root
    *above, name = layers.path.split(".")
    for part in above:
        child = _with_own_children(parent._modules[part])
        parent._modules[part] = child
        parent = child
    parent._modules[name] = nn.ModuleList(list(parent._modules[name])[:kept])
    return root


def _with_own_children(module: nn.Module) -> nn.Module:
    copied = copy.copy(module)
    copied._modules = dict(module._modules)  # the copy's own table: replacing a child leaves the original's
    return copied
