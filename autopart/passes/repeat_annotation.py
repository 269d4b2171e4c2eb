"""A deep model's annotation read off a shallow copy's, node by node.

Annotating a capture runs the whole graph once on fake tensors to find what each node saves for
backward (``autopart.passes.annotate``): minutes of Python for a model of a thousand layers, all
but a few of which repeat one another. ``laid_out`` takes the annotation of a copy of the model
with its first ``LAID_OUT_FROM`` layers (``autopart.passes.shallow``) and pairs each node of the
full capture with the copy's node in the same place (the embedding's with the copy's, layer i's
with the copy's layer i, every later layer's with the copy's last, the head's with its head),
giving each its partner's figures.

Nothing is taken on trust. Each pair must be the same op on the same target (a layer's weights
by their place in it), read the same constants, and read nodes in the same places relative to
its own (the layer before, the same layer, the embedding). And the copy's last layer must be
annotated as the layer before it, node for node: a tensor is charged to the first node that
saves it, so what a layer is charged for its inputs depends on what the layers before it saved
(the first layer is fed by the embedding, the rotary tables are charged to the first layer that
reads them). Two later layers alike say that the layers have settled: each further layer sees
its inputs as they did. Anything else (a layer whose graph differs, a node that reads two layers
back, layers that are not contiguous runs of nodes) and the caller annotates the full graph for
real.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from typing import Any

import torch
from torch import fx

from autopart.passes.annotate import NodeCost, OpGraph, module_path
from autopart.passes.capture import Graph

__all__ = ["laid_out", "LAID_OUT_FROM"]

LAID_OUT_FROM = 3
"""Layers of the copy ``laid_out`` reads: the first (fed by the embedding), then two that must agree."""

_Place = tuple[str, int]  # ("pre", 0), ("layer", i) or ("post", 0)


def laid_out(graph: Graph, shallow: OpGraph, layers_path: str) -> OpGraph | None:
    """The annotation of ``graph`` (the full model's capture, in the form ``shallow`` was captured
    in) read off ``shallow`` (its copy with fewer layers of the list at ``layers_path``, annotated);
    None where the two graphs are not alike as the module's docstring asks."""
    full_nodes, copy_nodes = list(graph.module.graph.nodes), list(shallow.graph.module.graph.nodes)
    layer_pattern = re.compile(rf"^{re.escape(layers_path)}\.(\d+)(?=\.|$)")  # "h.5" of "h.5.attn.c_attn"
    full, copy = _places(full_nodes, layer_pattern), _places(copy_nodes, layer_pattern)
    if full is None or copy is None:
        return None
    full_sizes, copy_sizes = Counter(place for place, _ in full), Counter(place for place, _ in copy)
    copy_layers = sum(1 for place in copy_sizes if place[0] == "layer")
    full_layers = sum(1 for place in full_sizes if place[0] == "layer")

    def partner_place(place: _Place) -> _Place:
        return ("layer", min(place[1], copy_layers - 1)) if place[0] == "layer" else place

    if copy_layers == 0 or full_layers < copy_layers or {partner_place(p) for p in full_sizes} != set(copy_sizes) \
            or any(n != copy_sizes[partner_place(p)] for p, n in full_sizes.items()):
        return None
    copy_at = {where: node for node, where in zip(copy_nodes, copy)}
    full_index = {node: where for node, where in zip(full_nodes, full)}
    copy_index = {node: where for node, where in zip(copy_nodes, copy)}
    if not _settled(shallow, copy_nodes, copy_index, copy_layers):
        return None
    nodes: dict[str, NodeCost] = {}
    kernels, leaves = {}, {}
    for node, (place, offset) in zip(full_nodes, full):
        partner = copy_at.get((partner_place(place), offset))
        if partner is None or not _alike(node, partner, place, partner_place(place), full_index, copy_index,
                                         (full_layers, copy_layers), layer_pattern):
            return None
        cost = shallow.nodes[partner.name]
        nodes[node.name] = replace(cost, name=node.name, module_path=module_path(node),
                                   weight_seed_reader=_partner_reader(node, partner, cost.weight_seed_reader))
        if partner.name in shallow.kernels:
            kernels[node.name] = shallow.kernels[partner.name]
        if partner.name in shallow.leaf_tensors:
            leaves[node.name] = {_renamed(name, layer_pattern, place): meta
                                 for name, meta in shallow.leaf_tensors[partner.name].items()}
    return replace(shallow, graph=graph, nodes=nodes, kernels=kernels, leaf_tensors=leaves)


def _partner_reader(node: fx.Node, partner: fx.Node, reader: str) -> str:
    """``node``'s reader where its partner's is ``reader`` (`autopart.passes.weight_seeds.shared_seeds`):
    the user in the same place; none where the users differ."""
    users = [u.name for u in partner.users]
    if not reader or reader not in users or len(node.users) != len(users):
        return ""
    return list(node.users)[users.index(reader)].name


def _places(nodes: list[fx.Node], layer_pattern: re.Pattern) -> list[tuple[_Place, int]] | None:
    """Per node, its place and its offset there; None where a layer's nodes are not one run, or
    the layers do not come in order 0, 1, 2, ... with nothing of the model's own between them."""
    found: list[tuple[_Place, int]] = []
    place: _Place = ("pre", 0)
    offset = 0
    for node in nodes:
        match = layer_pattern.match(module_path(node))
        if match is None:
            here: _Place = ("pre", 0) if place == ("pre", 0) else ("post", 0)
        else:
            here = ("layer", int(match.group(1)))
            if here != place and (place[0] == "post" or here[1] != (place[1] + 1 if place[0] == "layer" else 0)):
                return None
        offset = offset + 1 if here == place else 0
        place = here
        found.append((place, offset))
    return found


def _alike(node: fx.Node, partner: fx.Node, place: _Place, partner_place: _Place, full_index: dict,
           copy_index: dict, layers: tuple[int, int], layer_pattern: re.Pattern) -> bool:
    """Whether ``node`` (at ``place`` of the full graph) does what ``partner`` does in the copy."""
    if node.op != partner.op:
        return False
    if node.op in ("get_attr", "call_module"):
        if _renamed(str(node.target), layer_pattern, partner_place) != partner.target:
            return False
    elif node.target != partner.target:
        return False
    mine, theirs = [], []
    if _shape(node.args, mine) != _shape(partner.args, theirs) or _shape(node.kwargs, mine) != _shape(partner.kwargs, theirs):
        return False
    for a, b in zip(mine, theirs):
        if isinstance(a, fx.Node) or isinstance(b, fx.Node):
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                return False
            if _relative(full_index[a], place, layers[0]) != _relative(copy_index[b], partner_place, layers[1]):
                return False
        elif not _same_constant(a, b):
            return False
    return True


def _settled(shallow: OpGraph, nodes: list[fx.Node], index: dict, layers: int) -> bool:
    """Whether the copy's last layer is annotated as the layer before it, node for node (names and
    module paths aside): the figures every later layer of the full model will take."""
    if layers < LAID_OUT_FROM:
        return False
    last = [n for n in nodes if index[n][0] == ("layer", layers - 1)]
    before = [n for n in nodes if index[n][0] == ("layer", layers - 2)]
    if len(last) != len(before):
        return False
    for a, b in zip(before, last):
        if _unnamed(shallow.nodes[a.name]) != _unnamed(shallow.nodes[b.name]):
            return False
        if shallow.kernels.get(a.name) != shallow.kernels.get(b.name):
            return False
        if [*shallow.leaf_tensors.get(a.name, {}).values()] != [*shallow.leaf_tensors.get(b.name, {}).values()]:
            return False
    return True


def _unnamed(cost: NodeCost) -> NodeCost:
    """``cost`` without what names its node (its name, module path, the reader it shares seeds with)."""
    return replace(cost, name="", module_path="", weight_seed_reader="shared" if cost.weight_seed_reader else "")


def _shape(value: Any, leaves: list) -> Any:
    """The nesting of an argument (tuples, lists, dicts and slices, whose bounds may be nodes),
    its leaves appended to ``leaves`` in order."""
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_shape(v, leaves) for v in value)
    if isinstance(value, dict):
        return "dict", tuple((k, _shape(v, leaves)) for k, v in value.items())
    if isinstance(value, slice):
        return "slice", _shape(value.start, leaves), _shape(value.stop, leaves), _shape(value.step, leaves)
    leaves.append(value)
    return "leaf"


def _relative(where: tuple[_Place, int], reader: _Place, layers: int) -> tuple[Any, ...]:
    """Where a node read by a node at ``reader`` lies, as seen from there: a layer by how many
    layers back (from the last, for the head), anything else by its place."""
    (place, offset) = where
    if place[0] != "layer":
        return (place, offset)
    if reader[0] == "layer":
        return ("layers back", reader[1] - place[1], offset)
    return ("from the last", layers - 1 - place[1], offset)


def _same_constant(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # a value that cannot say: not the same, as far as we know
        return False


def _renamed(name: str, layer_pattern: re.Pattern, to: _Place) -> str:
    """``name`` (a weight's or a module's) with its layer index made ``to``'s, where both have one."""
    match = layer_pattern.match(name)
    if to[0] != "layer" or match is None:
        return name
    return name[:match.start(1)] + str(to[1]) + name[match.end(1):]
