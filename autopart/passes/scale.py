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
change with the shape) is not caught at the two sizes the line runs through, so ``SizeLines``
checks the line against a real annotation (`lines_agree`) before trusting it, and again at each
size beyond twice the largest it was checked at; a figure that leaves the line only between two
checked sizes, or within twice the last, would go unseen. Where a check fails, every size is
annotated for real. Only a cost model that costs kernels from their FLOPs and bytes alone can be
read this way: a database of measured ops keys them by shape.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import fields, replace
from fractions import Fraction
from typing import Any

from autopart.ir.tensors import TensorMeta
from autopart.passes.annotate import NodeCost, OpGraph
from autopart.passes.kernel_figures import kernel_figures, recompute_share
from autopart.passes.blocks import build_blocks
from autopart.passes.front import Front
from cost_models import CostModel, Kernel

__all__ = ["SizeLines", "affine_op_graph", "lines_agree"]

_TIMES = {"forward_s", "backward_input_s", "backward_weight_s", "selective_recompute_s"}  # re-costed
_FLOPS = {"forward_flops", "backward_flops"}  # summed from the kernels (``kernel_figures``)


class _OffLine(Exception):
    """Two annotations that differ in something no line passes through (an op, a dtype, a rank)."""


class SizeLines:
    """Annotated fronts at many micro-batch sizes from a few real ones, per form (bias form and
    dtype). The line runs through the first two real sizes of at least 2 (at size 1 some reshapes
    are views that copy at any larger size), is trusted once the next real size lies on it, and is
    read at most twice as far out as the largest size it was checked at: a size beyond is
    annotated for real and checked against it, so that a figure that leaves the line at some size
    (a clamp, a padding) is caught within a factor of two of it. A form whose check fails is
    annotated for real at every size from then on.

    ``largest``: the largest size the caller will ask for, where known (the search's space). The
    line is then first checked there, so that one check covers every size asked: checked at the
    next size asked instead, a larger one would need a check of its own. A figure that leaves the
    line between the bases and ``largest`` and comes back by ``largest`` then goes unseen (a
    clamp or a padding that leaves it stays off it)."""

    def __init__(self, largest: int | None = None) -> None:
        self.largest = largest
        self._real: dict[Hashable, dict[int, Front]] = {}
        self._lines: dict[Hashable, tuple[int, int, int] | None] = {}  # base sizes and the largest checked; None: failed

    def real(self, size: int, form: Hashable) -> Front | None:
        """The front annotated for real at ``size``, where one was."""
        return self._real.get(form, {}).get(size)

    def front(self, size: int, form: Hashable, annotate: Callable[[int], Front]) -> Front:
        """The front at ``size``: real where it was annotated, read off the form's line where that
        is trusted, else ``annotate(size)``."""
        real = self._real.setdefault(form, {})
        if size in real:
            return real[size]
        if form not in self._lines and self.largest is not None and 2 <= size < self.largest \
                and len([s for s in real if s >= 2]) >= 2:
            self.front(self.largest, form, annotate)  # the line's check, where the caller reaches farthest
        line = self._lines.get(form)
        if line is not None and size <= 2 * line[2]:
            read = self._read(real, line, size)
            if read is not None:
                return read
        front = real[size] = annotate(size)
        if size < 2:
            return front
        if form not in self._lines:  # not yet checked: the line through the first two sizes, checked here
            bases = sorted(s for s in real if s >= 2 and s != size)[:2]
            if len(bases) < 2:
                return front
            line = (*bases, size)
        elif line is None or size <= 2 * line[2]:
            return front  # a failed line, or a size the line could not give (a figure not whole)
        checked = self._read(real, line, size)
        self._lines[form] = (line[0], line[1], max(size, line[2])) \
            if checked is not None and lines_agree(checked.op_graph, front.op_graph) else None
        return front

    @staticmethod
    def _read(real: dict[int, Front], line: tuple[int, int, int], size: int) -> Front | None:
        first, second = real[line[0]], real[line[1]]
        graph = affine_op_graph(first.op_graph, second.op_graph, size, first.cost_model)
        return None if graph is None else replace(first, op_graph=graph, chain=build_blocks(graph), timed=0)


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
        if len(kernels) != len(real.kernels[name]):
            return False
        for ours, theirs in zip(kernels, real.kernels[name]):
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
        self.step = Fraction(size - a, b - a)

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

    def constant(self, x: Any, y: Any) -> Any:
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


def _pairs(x: tuple, y: tuple | None) -> Iterator[tuple]:
    """``x`` and ``y`` side by side, which must be as long."""
    if y is None or len(x) != len(y):
        raise _OffLine
    return zip(x, y)


def _node(x: NodeCost, y: NodeCost, line: _Line, kernels: tuple[tuple[Kernel, ...], ...] | None,
          cost_model: CostModel) -> NodeCost:
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
    times = cost_model.op_times("", *kernels)
    share = recompute_share(kernels[0], cost_model) if x.needs_grad else 0.0  # no backward: nothing recomputed for it
    return replace(x, **changes, **kernel_figures(kernels, times, share))


def _kernels_agree(x: Kernel, y: Kernel, rel: float) -> bool:
    return (x.op, x.category, x.dtype) == (y.op, y.category, y.dtype) and _close(x.flops, y.flops, rel) \
        and _close(x.bytes, y.bytes, rel)


def _close(x: float, y: float, rel: float) -> bool:
    return abs(x - y) <= rel * max(abs(x), abs(y))
