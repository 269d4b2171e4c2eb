"""Graph rewrites that widen the choices of later passes without changing what the graph computes."""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
from torch import fx
from torch.nn import functional as F

from autopart.passes.capture import Graph

__all__ = ["separate_biases"]

_LINEAR = (F.linear, torch._C._nn.linear, torch.ops.aten.linear.default)
_ATEN = torch.ops.aten


def separate_biases(graph: Graph) -> Graph:
    """``linear(x, w, b)`` becomes ``linear(x, w) + b.type_as(...)``, and an exported Conv1D's
    ``addmm(b, x, w)`` becomes ``mm(x, w) + b.type_as(...)``.

    A row-parallel linear produces partial sums; its bias must be added once, after they are
    reduced. With the bias as an op of its own, the sharding solver can place the reduction
    between the two (Megatron's layout) instead of having to replicate the whole linear.

    The capture is rewritten in place: each caller hands over a capture of its own, and copying
    the module of a model of a hundred layers takes longer than the rewrite.
    """
    module = graph.module
    for node in list(module.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _LINEAR:
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            product, operands = node.target, (node.args[0], node.args[1])
        elif node.target is _ATEN.addmm.default and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
            bias = node.args[0]
            product, operands = _ATEN.mm.default, (node.args[1], node.args[2])
        else:
            continue
        if not isinstance(bias, fx.Node):
            continue
        aten = isinstance(product, torch._ops.OpOverload)
        with module.graph.inserting_after(node):
            # the bias in the product's dtype: under autocast the fused op adds it in 16 bits, and an
            # fp32 bias would otherwise promote the sum and everything after it to fp32
            cast = (module.graph.call_function(_ATEN.type_as.default, (bias, node)) if aten
                    else module.graph.call_method("type_as", (bias, node)))  # fmt: skip
        with module.graph.inserting_after(cast):
            added = module.graph.call_function(_ATEN.add.Tensor if aten else operator.add, (node, cast))
        node.replace_all_uses_with(added, delete_user_cb=lambda user: user not in (added, cast))
        node.target, node.args, node.kwargs = product, operands, {}
        added.meta = dict(node.meta)
        cast.meta = dict(node.meta)
    module.graph.lint()
    module.recompile()
    return replace(graph, module=module)
