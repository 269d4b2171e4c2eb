"""What a per-op formula is given, and the shape and byte arithmetic every formula shares.

Formulas read shapes only, never values, so they work alike on real, meta and fake tensors;
sizes that are symbolic (dynamic shapes under ``FakeTensorMode``) are read from their hints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

__all__ = [
    "CATEGORIES", "OpCall", "Rule", "arg", "concrete_int", "first_input_numel",
    "first_output_numel", "io_bytes", "numel", "per_input_element", "per_output_element",
    "shape", "tensor_bytes", "written_bytes", "zero",
]

CATEGORIES = (
    "matmul", "attention", "elementwise", "reduction", "norm",
    "softmax", "embedding", "loss", "copy", "view",
)

def _hint(value: torch.SymInt) -> int:
    """The size a symbolic int had when traced; read without adding a guard."""
    try:  # torch >= 2.9 names it so; older releases keep the hint on the node
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # pragma: no cover - depends on the installed torch
        hint = getattr(value.node, "hint", None)
        return int(hint) if hint is not None else 1
    return int(optimization_hint(value, fallback=1))


def concrete_int(value: Any) -> int:
    """An int for a size that may be symbolic, read from its hint so that no guard is added."""
    if isinstance(value, torch.SymInt):
        return _hint(value)
    return int(value)


def numel(tensor: torch.Tensor) -> int:
    return prod(concrete_int(size) for size in tensor.shape)


def shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(concrete_int(size) for size in tensor.shape)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes the tensor occupies in memory: a broadcast (stride 0) dimension counts once."""
    if tensor.layout != torch.strided:
        return numel(tensor) * tensor.element_size()
    elements = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        size = concrete_int(size)
        if size == 0:
            return 0
        if concrete_int(stride) != 0:
            elements *= size
    return elements * tensor.element_size()


@dataclass(frozen=True, kw_only=True)
class OpCall:
    """One aten call as a formula sees it."""

    name: str
    """The op's name without namespace or overload, e.g. ``"mm"``."""
    args: Mapping[str, Any]
    """Arguments by their schema names, so that formulas do not depend on positions."""
    inputs: tuple[torch.Tensor, ...]
    """Tensor arguments, each object once."""
    outputs: tuple[torch.Tensor, ...]
    """Tensors returned."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """How to cost one op: its category, its FLOPs and, where the default is wrong, its bytes."""

    category: str
    flops: Callable[[OpCall], float]
    bytes: Callable[[OpCall], float] | None = None
    """None: every input read once and every output written once."""


def io_bytes(call: OpCall) -> float:
    return float(sum(tensor_bytes(t) for t in call.inputs) + sum(tensor_bytes(t) for t in call.outputs))


def written_bytes(call: OpCall) -> float:
    return float(sum(tensor_bytes(t) for t in call.outputs))


def first_output_numel(call: OpCall) -> int:
    return numel(call.outputs[0]) if call.outputs else 0


def first_input_numel(call: OpCall) -> int:
    return numel(call.inputs[0]) if call.inputs else 0


def arg(call: OpCall, *names: str) -> Any:
    for name in names:
        if call.args.get(name) is not None:
            return call.args[name]
    return None


def per_output_element(flops: float) -> Callable[[OpCall], float]:
    return lambda call: flops * first_output_numel(call)


def per_input_element(flops: float) -> Callable[[OpCall], float]:
    return lambda call: flops * first_input_numel(call)


def zero(call: OpCall) -> float:
    return 0.0
