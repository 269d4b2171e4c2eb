"""Which of a graph's ``get_attr`` tensors its ops write in place, directly or through a view.

A forward that updates a buffer (a counter, BatchNorm's running statistics, an EMA, a queue
written a slice at a time) must have that buffer moved once a step by the runtime
(`autopart.runtime.buffer_updates`), and the runtime tracks no other: what this misses moves once
per microbatch, so it errs towards a buffer too many. A write reaches a buffer through any chain
of views (``self.buf[:, 0].add_(1)``, ``self.buf.view(-1)[0] = x``, ``buf.t().index_put_(...)``),
which no op's schema shows as a write to the buffer itself: the written value's aliases are
followed back, as torch.export (ATen schemas, ``Tensor(a)``) and torch.fx (method and function
names) capture them.

An op whose effects are unknown (a --leaf module, a function of the user's that fx kept whole)
is taken to write every tensor it is given, and to return a view of each.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

from autopart.ir.errors import CaptureError, ModelFileError

__all__ = ["written_attributes", "written_inputs", "written_in_forward", "writes_in_place", "check_no_written_copies",
           "check_constants_have_values", "check_inputs_unwritten", "check_fx_graph", "buffer_versions",
           "check_writes_recorded", "unrecorded_writes", "normalises_by_batch", "batch_norm_statistics"]

# modules whose functions write no argument unless their name or arguments say so (a trailing
# underscore, ``inplace=True``, ``out=``): torch's, and Python's own operators
_KNOWN_MODULES = ("torch", "_operator", "operator", "builtins", "math")
_SETITEM = ("__setitem__", "setitem")


def written_attributes(graph: fx.Graph) -> set[str]:
    """The ``get_attr`` targets (parameters, buffers, constants) whose memory some op of ``graph``
    writes: its own argument, a view of one, or a batch norm's running statistics in training."""
    return _written_roots(graph, "get_attr")


def written_inputs(graph: fx.Graph) -> set[str]:
    """The placeholders (a stage's received tensors and batch values) whose memory some op of
    ``graph`` writes, directly or through a view: a stage that wrote what it received would write
    a leaf of autograd (refused), the same tensor again in recompute, or a batch value another
    stage of the rank reads too. Only writes the graph shows: a ``--leaf`` module or a function
    kept whole is taken to write nothing of its inputs here (it would otherwise be taken to write
    every hidden state passed to a layer, and each stage to copy it)."""
    return _written_roots(graph, "placeholder", opaque=False)


def _written_roots(graph: fx.Graph, op: str, *, opaque: bool = True) -> set[str]:
    """The nodes of kind ``op`` (by ``get_attr`` target, or placeholder name) whose memory some op
    writes; ``opaque``: a call whose effects the graph does not show (`_opaque`) writes all it takes."""
    aliases: dict[fx.Node, frozenset[str]] = {}  # node -> the roots whose memory its value may share
    written: set[str] = set()
    for node in graph.nodes:
        if node.op == op:
            aliases[node] = frozenset({str(node.target) if op == "get_attr" else node.name})
            continue
        if node.op not in ("call_function", "call_method", "call_module") or (not opaque and _opaque(node)):
            continue
        for value in (*_written_arguments(node), *batch_norm_statistics(node)):
            written |= aliases.get(value, frozenset())
        shared = frozenset().union(*(aliases.get(value, frozenset()) for value in _aliased_arguments(node)))
        if shared:
            aliases[node] = shared
    return written


def written_in_forward(graph: fx.Graph) -> set[str]:
    """The names of the values made in forward (no input or attribute shares their memory) that
    some op of ``graph`` writes in place, with every value sharing their memory: the views of one,
    the base it views, an in-place op's own result. Such a value is what it was after its writes
    only where it was written: a stage that made it again from the batch would read it unwritten."""
    group: dict[fx.Node, fx.Node] = {}  # node -> another node sharing its memory, towards one root

    def root(node: fx.Node) -> fx.Node:
        while group.get(node, node) is not node:
            node = group[node]
        return node

    written: list[fx.Node] = []
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        for value in _aliased_arguments(node):
            if root(value) is not root(node):
                group[root(node)] = root(value)
        written += _written_arguments(node)
    members: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        members.setdefault(root(node), []).append(node)
    found: set[str] = set()
    for base in {root(node) for node in written}:
        if all(node.op not in ("placeholder", "get_attr") for node in members[base]):  # a buffer's: the runtime's
            found.update(node.name for node in members[base])
    return found


def check_no_written_copies(module: fx.GraphModule, constants: tuple[str, ...], model: nn.Module) -> None:
    """Refuse a graph with a constant sharing memory with a buffer, where the graph writes either:
    fx computes a view of a buffer that no traced value reaches (``self.buf[:, 0]``) as it traces
    and keeps the view as a constant, which the stage files load as a tensor of its own. Writing
    that copy, the programs would never write the buffer; reading it in an update of the buffer
    (``self.total[0] = x + self.total[0]``), they would read the buffer as built at every step. While
    tracing the two share memory, so no run of the graph in this process tells them apart: the
    storages are compared, by identity, which a model built on the meta device has too."""
    owners = {_storage(b): name for name, b in model.named_buffers()}
    owners.pop(None, None)
    written = written_attributes(module.graph)
    for constant in sorted(constants, key=lambda c: c not in written):  # a written copy first: the worse
        value = functools.reduce(lambda owner, part: getattr(owner, part, None), constant.split("."), module)
        owner = owners.get(_storage(value)) if isinstance(value, torch.Tensor) else None
        if owner is None:
            continue
        if constant in written:
            raise CaptureError(f"the model's forward writes its buffer {owner!r} through a view that torch.fx "
                               "keeps as a copy (a view of a buffer that no traced value reaches)")
        if owner in written:
            raise CaptureError(f"the model's forward reads its buffer {owner!r}, which it changes, through a view "
                               "that torch.fx keeps as a copy (a view of a buffer that no traced value reaches)")


def check_constants_have_values(module: fx.GraphModule, constants: tuple[str, ...]) -> None:
    """Refuse a graph with a constant on the meta device: fx computes what no traced value reaches
    (``0.5 * self.buf[1]``) as it traces, and from a model built on the meta device that is a
    tensor without values, which the stage files could not load (the emitted weights hold each
    constant's values)."""
    for constant in constants:
        value = functools.reduce(lambda owner, part: getattr(owner, part, None), constant.split("."), module)
        if isinstance(value, torch.Tensor) and value.is_meta:
            raise CaptureError(f"torch.fx computes {constant} as it traces, from the model's tensors on the meta "
                               "device, which have no values to keep (a read that no traced value reaches)")


def check_inputs_unwritten(graph: fx.Graph) -> None:
    """Refuse a forward that writes its own input in place (``x.add_(y)``, ``x.masked_fill_(m, 0)``):
    each pipeline stage reads the batch as it came, where the model's ops after the write read it
    written, and a stage that holds only those would train another function, in silence."""
    written = [node.name for node in graph.nodes if node.op == "placeholder" and node.name in written_inputs(graph)]
    if written:
        raise CaptureError(f"the model's forward writes its input {written[0]!r} in place, which the pipeline's "
                           f"stages would read unwritten; copy it first in forward ({written[0]} = {written[0]}.clone())")


def check_fx_graph(module: fx.GraphModule, constants: tuple[str, ...], model: nn.Module) -> None:
    """What torch.fx's graph of ``model`` may hold that the stages would run otherwise than the
    model (`check_no_written_copies`, `check_constants_have_values`, `check_inputs_unwritten`)."""
    check_no_written_copies(module, constants, model)
    check_constants_have_values(module, constants)
    check_inputs_unwritten(module.graph)


def buffer_versions(model: nn.Module) -> dict[str, int]:
    """Each buffer's version counter, which every in-place write advances, through any view, on
    the meta device too: what a forward wrote, where there are no values to compare."""
    return {name: b._version for name, b in model.named_buffers(remove_duplicate=False)}


def check_writes_recorded(module: fx.GraphModule, model: nn.Module, versions: dict[str, int]) -> None:
    """Refuse a graph that writes no buffer that the model's forwards wrote since ``versions``
    (`buffer_versions`) by an op that no traced tensor reaches (``self.steps.add_(1)``): fx runs it
    once while tracing and records nothing, so the stages would never move the buffer. A --leaf
    module's call writes its own buffers."""
    written = written_attributes(module.graph)
    whole = tuple(f"{n.target}." for n in module.graph.nodes if n.op == "call_module")
    buffers = dict(model.named_buffers(remove_duplicate=False))
    names: dict[int, list[str]] = {}  # a buffer under all its names: the graph reads it under one
    for name, buffer in buffers.items():
        names.setdefault(id(buffer), []).append(name)
    missing = sorted(aliases[0] for aliases in names.values()
                     if buffers[aliases[0]]._version != versions.get(aliases[0], buffers[aliases[0]]._version)
                     and not any(n in written or n.startswith(whole) for n in aliases))
    if missing:
        raise unrecorded_writes(missing)


def unrecorded_writes(missing: list[str]) -> CaptureError:
    """The refusal of a forward that changes the buffers ``missing`` by ops the graph lacks."""
    return CaptureError(
        f"the model's forward changes its buffer {missing[0]!r}{f' (and {len(missing) - 1} more)' if missing[1:] else ''}"
        " by an op that the capture cannot record (an in-place update that no input tensor reaches, "
        "as a step counter's); update it outside forward, or make it a plain attribute"
    )


def _storage(tensor: torch.Tensor) -> StorageWeakRef | None:
    """The storage that ``tensor``'s views share, by identity (a meta tensor's has no address to
    compare); None for a tensor without one (sparse)."""
    try:
        return StorageWeakRef(tensor.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def writes_in_place(node: fx.Node) -> bool:
    """An op that writes an argument: one an ATen schema marks ``Tensor(a!)`` (torch.export), an
    fx method or function whose name ends in an underscore (``x.add_``), ``inplace=True``,
    ``out=``, or an item set (``buf[0] = x``, which fx records as ``__setitem__``). A graph keeps
    such an op though nothing reads its value, and a stage runs it once; a call whose effects are
    unknown (`_opaque`) is left to fx's own rule of what is pure."""
    if node.op not in ("call_function", "call_method"):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    return bool(_written_arguments(node)) and not _opaque(node)


def _nodes(value: object) -> list[fx.Node]:
    """The nodes in an argument: itself, or those of a list or tuple (``index_put_``'s indices)."""
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in _nodes(item)]
    return []


def _argument(node: fx.Node, position: int, name: str) -> object:
    return node.args[position] if position < len(node.args) else node.kwargs.get(name)


def _name(node: fx.Node) -> str:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name if isinstance(name, str) else ""


def _opaque(node: fx.Node) -> bool:
    """A call whose effects on its arguments the graph does not show: a --leaf module, or a
    function that is neither an ATen overload nor torch's or Python's own."""
    if node.op == "call_module":
        return True
    if node.op != "call_function" or getattr(node.target, "_schema", None) is not None:
        return False
    module = getattr(node.target, "__module__", None) or type(node.target).__module__ or ""
    return module.split(".")[0] not in _KNOWN_MODULES


def _written_arguments(node: fx.Node) -> list[fx.Node]:
    """The arguments that ``node`` writes: those its schema marks ``Tensor(a!)``, else by name."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return [n for k, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
                for n in _nodes(_argument(node, k, a.name))]
    if _opaque(node):
        return list(node.all_input_nodes)
    name = _name(node)
    found = _nodes(node.kwargs.get("out"))
    if node.args and (node.kwargs.get("inplace") is True or name in _SETITEM
                      or (name.endswith("_") and not name.endswith("__"))):
        found += _nodes(node.args[0])
    return found


def _aliased_arguments(node: fx.Node) -> list[fx.Node]:
    """The arguments whose memory the value of ``node`` may share: a view's base (``view``,
    ``select``, ``t``, ``getitem``...), an in-place op's written argument, which it returns."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        # a returned ``Tensor(a)`` or ``Tensor(a)[]`` shares an annotated argument's memory (the
        # schema gives a list's element sets not at all: every annotated argument, conservatively)
        if all(r.alias_info is None for r in schema.returns):
            return []
        return [n for k, a in enumerate(schema.arguments) if a.alias_info is not None
                for n in _nodes(_argument(node, k, a.name))]
    if _opaque(node):
        return list(node.all_input_nodes)
    name = _name(node)
    if node.target is operator.getitem or name == "__getitem__" or _returns_view(name) or name.endswith("_"):
        return _nodes(node.args[0]) if node.args else []
    if node.target is getattr and len(node.args) > 1 and node.args[1] in _VIEW_ATTRIBUTES:
        return _nodes(node.args[0])
    return []


_VIEW_ATTRIBUTES = frozenset(("T", "mT", "H", "mH", "data", "real", "imag"))
"""Tensor attributes that are views of it (``buf.T[0].add_(1)``, fx's ``getattr(buf, 'T')``)."""


@functools.cache
def _returns_view(name: str) -> bool:
    """Whether some ATen op of this name returns a view of an argument (``view``, ``reshape``,
    ``transpose``, ``split``...): a method or torch function of that name may then too."""
    if not name.isidentifier() or name.startswith("_"):
        return False
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    try:
        schemas = [getattr(packet, overload)._schema for overload in packet.overloads()]
    except (AttributeError, RuntimeError):
        return True  # an ATen op whose schemas cannot be read: conservatively a view
    return any(r.alias_info is not None and not r.alias_info.is_write for s in schemas for r in s.returns)


def normalises_by_batch(node: fx.Node) -> bool:
    """``node`` is a batch norm that normalises by its batch: one whose ``training`` (or ``train``)
    argument is true, found by name in the op's schema (an ATen overload) or at the place
    ``F.batch_norm`` gives it; ``_batch_norm_with_update`` trains by its name, ``_no_update`` and
    ``_no_training`` do not."""
    target = node.target
    name = str(getattr(target, "__name__", target))
    if node.op != "call_function" or "batch_norm" not in name:
        return False
    if "with_update" in name:
        return True
    if "no_update" in name or "no_training" in name:
        return False
    schema = getattr(target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else \
        ["input", "running_mean", "running_var", "weight", "bias", "training"]  # F.batch_norm
    place = next((i for i, n in enumerate(names) if n in ("training", "train")), None)
    if place is None:
        return False
    flag = node.args[place] if len(node.args) > place else node.kwargs.get(names[place], False)
    return flag is True


def batch_norm_statistics(node: fx.Node) -> list[fx.Node]:
    """The running statistics that a batch norm normalising by its batch (`normalises_by_batch`)
    writes as it runs: a kernel that says nothing of it in its schema (``aten.batch_norm``,
    ``F.batch_norm``)."""
    if not normalises_by_batch(node):
        return []
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else \
        ["input", "running_mean", "running_var", "weight", "bias", "training"]  # F.batch_norm
    found = [node.args[k] if k < len(node.args) else node.kwargs.get(name) for k, name in enumerate(names)
             if name in ("running_mean", "running_var")]
    return [value for value in found if isinstance(value, fx.Node)]


def check_buffers_hold_no_graph(module: nn.Module) -> None:
    """Refuse a buffer that holds a value computed from trained parameters, written by a forward
    (``self.buf.copy_(self.w * 2)``) or by ``__init__``: the buffer keeps that autograd graph, and
    the next write chains onto it, so the next backward runs through the freed graph and fails
    (in the model's own training loop too). Called after a forward with gradients on. A buffer
    that is a leaf, even one that requires grad, holds no graph: it is left alone."""
    held = sorted(name for name, buffer in module.named_buffers() if buffer.grad_fn is not None)
    if held:
        raise ModelFileError(
            f"the model's buffer {held[0]!r}{f' (and {len(held) - 1} more)' if held[1:] else ''} holds a value "
            "computed from trained parameters (written in forward or in __init__), so it keeps that autograd graph "
            "and the next backward runs through it again (it fails in the model's own training loop too); write a "
            "detached value (.copy_(value.detach())), or keep the value a plain tensor of the forward rather than "
            "a buffer"
        )

