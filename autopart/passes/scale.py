"""An annotated graph at a micro-batch size read off the line through two others.

The search asks for the chain's costs at every micro-batch size it visits (nine up to 16), and
each real annotation (`autopart.passes.annotate`) runs the whole graph on fake tensors and every
new op's forward and backward again: most of the search's front. The graph itself does not change
with the size, only its shapes do, and in a Transformer every figure that annotation records is
affine in the micro-batch size ``b``: each dimension of each shape (``b``, ``b * s`` or fixed), the
FLOPs and bytes of each kernel, the bytes saved for backward. ``affine_op_graph`` puts each of
them on the line through two real annotations and re-costs each kernel with the cost model, as
annotation itself does: the roofline's time is a function of the kernel's FLOPs and bytes.

A figure off that line (a B x B similarity matrix, a size clamped by ``min``, an op whose kernels
change with the shape) is not caught at the two sizes the line runs through, so the caller
checks the line once against a third real annotation (`lines_agree`) before trusting it, and
annotates for real wherever the check failed. Only a cost model that costs kernels from their
FLOPs and bytes alone can be read this way: a database of measured ops keys them by shape.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import fields, replace
from fractions import Fraction

from autopart.ir.tensors import TensorMeta
from autopart.passes.annotate import NodeCost, OpGraph, recompute_share
from autopart.passes.blocks import build_blocks
from autopart.passes.front import Front
from cost_models import CostModel, Kernel

__all__ = ["SizeLines", "affine_op_graph", "lines_agree"]


class SizeLines:
    """Annotated fronts at many micro-batch sizes from a few real ones, per form (bias form and
    dtype): the line runs through the two smallest real sizes of at least 2 (at size 1 some
    reshapes are views that copy at any larger size) and is trusted once the next real one lies
    on it; a form whose check fails is annotated for real at every size."""

    def __init__(self) -> None:
        self._real: dict[Hashable, dict[int, Front]] = {}
        self._trusted: dict[Hashable, bool] = {}

    def front(self, size: int, form: Hashable, annotate: Callable[[], Front]) -> Front:
        """The front at ``size``: read off the form's line where it is trusted, else ``annotate()``."""
        real = self._real.setdefault(form, {})
        bases = sorted(s for s in real if s >= 2)[:2]
        on_line = size >= 2 and len(bases) == 2
        if on_line and self._trusted.get(form):
            base = real[bases[0]]
            line = affine_op_graph(base.op_graph, real[bases[1]].op_graph, size, base.cost_model)
            if line is not None:
                return replace(base, op_graph=line, chain=build_blocks(line), timed=0)
        front = real[size] = annotate()
        if on_line and form not in self._trusted:
            line = affine_op_graph(real[bases[0]].op_graph, real[bases[1]].op_graph, size, front.cost_model)
            self._trusted[form] = line is not None and lines_agree(line, front.op_graph)
        return front

_TIMES = {"forward_s", "backward_input_s", "backward_weight_s", "selective_recompute_s"}  # re-costed
_FLOPS = {"forward_flops", "backward_flops"}  # summed from the kernels, as annotation sums them


class _OffLine(Exception):
    """Two annotations that differ in something no line passes through (an op, a dtype, a rank)."""


def affine_op_graph(first: OpGraph, second: OpGraph, size: int, cost_model: CostModel) -> OpGraph | None:
    """The annotation at micro-batch ``size`` on the line through ``first`` and ``second`` (two
    annotations of one graph at two sizes, in one dtype), each kernel re-costed by ``cost_model``;
    None where the two differ in more than their figures, or a figure would leave the integers."""
    a, b = first.micro_batch_size, second.micro_batch_size
    if a == b or first.graph is not second.graph or first.dtype != second.dtype \
            or first.leaf_tensors != second.leaf_tensors or first.nodes.keys() != second.nodes.keys():
        return None
    line = _Line(a, b, size)
    try:
        kernels = {name: tuple(tuple(line.kernel(x, y) for x, y in _pairs(xs, ys))
                               for xs, ys in _pairs(groups, second.kernels.get(name)))
                   for name, groups in first.kernels.items()}
        if kernels.keys() != second.kernels.keys():
            raise _OffLine
        nodes = {name: _node(cost, second.nodes[name], line, kernels.get(name), cost_model)
                 for name, cost in first.nodes.items()}
    except _OffLine:
        return None
    return replace(first, nodes=nodes, kernels=kernels, micro_batch_size=size)


def lines_agree(line: OpGraph, real: OpGraph, *, rel: float = 1e-9) -> bool:
    """Whether an annotation read off a line equals a real one at the same size: every node's
    shapes, bytes and constants exactly, every FLOP count and time to ``rel``."""
    if line.micro_batch_size != real.micro_batch_size or line.nodes.keys() != real.nodes.keys() \
            or line.kernels.keys() != real.kernels.keys():
        return False
    for name, kernels in line.kernels.items():
        for ours, theirs in _pairs(kernels, real.kernels[name], check=False):
            if len(ours) != len(theirs) or not all(_kernels_agree(x, y, rel) for x, y in zip(ours, theirs)):
                return False
    for name, ours in line.nodes.items():
        theirs = real.nodes[name]
        for field in fields(NodeCost):
            x, y = getattr(ours, field.name), getattr(theirs, field.name)
            if field.name in _TIMES or field.name in _FLOPS:
                if not _close(x, y, rel):
                    return False
            elif x != y:
                return False
    return True


class _Line:
    """Values at sizes ``a`` and ``b`` carried to ``size``."""

    def __init__(self, a: int, b: int, size: int):
        self.a, self.step = a, Fraction(size - a, b - a)

    def integer(self, x: int, y: int, *, signed: bool = False) -> int:
        value = x + (y - x) * self.step
        if value.denominator != 1 or (value < 0 and not signed):
            raise _OffLine
        return int(value)

    def real(self, x: float, y: float) -> float:
        if float(x).is_integer() and float(y).is_integer():
            return float(self.integer(int(x), int(y)))
        value = x + (y - x) * float(self.step)
        if value < 0:
            raise _OffLine
        return value

    def kernel(self, x: Kernel, y: Kernel) -> Kernel:
        if (x.op, x.category, x.dtype) != (y.op, y.category, y.dtype):
            raise _OffLine
        return replace(x, flops=self.real(x.flops, y.flops), bytes=self.real(x.bytes, y.bytes))

    def meta(self, x: TensorMeta | None, y: TensorMeta | None) -> TensorMeta | None:
        if x is None or y is None:
            if x is not y:
                raise _OffLine
            return None
        if x.dtype != y.dtype or len(x.shape) != len(y.shape):
            raise _OffLine
        return TensorMeta(shape=tuple(self.integer(p, q) for p, q in zip(x.shape, y.shape)), dtype=x.dtype)

    def constant(self, x, y):
        if type(x) is not type(y):
            raise _OffLine
        if isinstance(x, int) and not isinstance(x, bool):
            return self.integer(x, y, signed=True)  # a dimension may be -1
        if isinstance(x, tuple):
            if len(x) != len(y):
                raise _OffLine
            return tuple(self.constant(p, q) for p, q in zip(x, y))
        if x != y:  # a float, a bool, None: a line through two values is only trusted for integers
            raise _OffLine
        return x


def _pairs(x, y, check: bool = True):
    if y is None or len(x) != len(y):
        if check:
            raise _OffLine
        return ()
    return zip(x, y)


def _node(x: NodeCost, y: NodeCost, line: _Line, kernels, cost_model: CostModel) -> NodeCost:
    """One node's annotation on the line, its times re-costed from its kernels."""
    changes = {}
    for field in fields(NodeCost):
        p, q = getattr(x, field.name), getattr(y, field.name)
        if field.name in _TIMES or field.name in _FLOPS:
            continue
        if field.name == "output":
            changes["output"] = line.meta(p, q)
        elif field.name == "constant":
            changes["constant"] = line.constant(p, q)
        elif isinstance(p, int) and not isinstance(p, bool):
            changes[field.name] = line.integer(p, q)
        elif p != q:
            raise _OffLine
    if kernels is None:  # placeholders, attributes, the output: no kernels, no time
        if any(getattr(x, f) != getattr(y, f) for f in (*_TIMES, *_FLOPS)):
            raise _OffLine
        return replace(x, **changes)
    forward, backward_input, backward_weight = kernels
    times = cost_model.op_times("", forward, backward_input, backward_weight)
    return replace(
        x, **changes,
        forward_flops=float(sum(k.flops for k in forward)),
        backward_flops=float(sum(k.flops for k in backward_input)) + float(sum(k.flops for k in backward_weight)),
        forward_s=times.forward_s,
        backward_input_s=times.backward_input_s,
        backward_weight_s=times.backward_weight_s,
        selective_recompute_s=times.forward_s * recompute_share(forward, cost_model),
    )


def _kernels_agree(x: Kernel, y: Kernel, rel: float) -> bool:
    return (x.op, x.category, x.dtype) == (y.op, y.category, y.dtype) and _close(x.flops, y.flops, rel) \
        and _close(x.bytes, y.bytes, rel)


def _close(x: float, y: float, rel: float) -> bool:
    return abs(x - y) <= rel * max(abs(x), abs(y))
