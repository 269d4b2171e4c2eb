"""Graph rewrites that widen the choices of later passes without changing what the graph computes."""

from __future__ import annotations

import copy
import operator
from dataclasses import replace

import torch
from torch import fx
from torch.nn import functional as F

from autopart.capture import Graph

__all__ = ["separate_biases"]

_LINEAR = (F.linear, torch._C._nn.linear)


def separate_biases(graph: Graph) -> Graph:
    """``linear(x, w, b)`` becomes ``linear(x, w) + b``.

    A row-parallel linear produces partial sums; its bias must be added once, after they are
    reduced. With the bias as an op of its own, the sharding solver can place the reduction
    between the two (Megatron's layout) instead of having to replicate the whole linear.
    """
    module = fx.GraphModule(graph.module, copy.deepcopy(graph.module.graph), class_name="TrainingGraph")
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target not in _LINEAR:
            continue
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if not isinstance(bias, fx.Node):
            continue
        x, weight = node.args[0], node.args[1]
        with module.graph.inserting_after(node):
            added = module.graph.call_function(operator.add, (node, bias))
        node.replace_all_uses_with(added, delete_user_cb=lambda user: user is not added)
        node.args, node.kwargs = (x, weight), {}
        added.meta = dict(node.meta)
    module.graph.lint()
    module.recompile()
    return replace(graph, module=module)
