"""The key an op's cost is stored and looked up by: the function, and per argument its shape,
dtype and role (`op_key`), and the precision it runs in (`cost_key`). Names are left out, so the
nodes of repeated layers share one key and are measured once (`autopart.passes.annotate`,
`autopart.profiling.profile`)."""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import torch
from torch import fx

__all__ = ["cost_key", "op_key"]


def _target_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    return f"{module}.{name}".removeprefix("torch._C._nn.").removeprefix("_operator.")


def op_key(node: fx.Node, args: tuple, kwargs: dict, parameters: set[int], frozen: Set[int] = frozenset()) -> str:
    """What an op's cost depends on: the function, and per argument its shape, dtype and role.

    Tensors print as ``float32[2,32,64]`` with ``:w`` for a parameter (weight gradient), ``:f``
    for a ``frozen`` one (no gradient), ``:g`` for another floating tensor (input gradient) and
    ``:nc`` when not contiguous;
    other arguments by value. Names are left out, so repeated layers give the same keys.
    """

    def describe(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            text = f"{str(value.dtype).removeprefix('torch.')}[{','.join(map(str, value.shape))}]"
            if id(value) in frozen:
                text += ":f"
            elif id(value) in parameters:
                text += ":w"
            elif value.is_floating_point():
                text += ":g"
            return text if value.is_contiguous() else text + ":nc"
        if isinstance(value, (list, tuple)):
            inner = ",".join(describe(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner})"
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}={describe(v)}" for k, v in value.items()) + "}"
        return repr(value)

    parts = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()]
    return f"{_target_name(node)}({', '.join(parts)})"


def cost_key(node: fx.Node, args: tuple, kwargs: dict, parameters: set[int], dtype: str,
             frozen: Set[int] = frozenset()) -> str:
    """The cost database's key of an op run in precision ``dtype``: its `op_key`, and under bf16
    the autocast it ran in (its arguments may be fp32 while it runs in 16 bits: not the op that
    an fp32 run timed). `autopart.profiling.profile` stores under this key, annotate looks it up."""
    key = op_key(node, args, kwargs, parameters, frozen)
    return key if dtype == "fp32" else f"{key} autocast=bf16"  # which bf16: the weights' dtypes in the key say
