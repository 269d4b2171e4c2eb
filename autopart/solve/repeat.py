"""A deep model's chain costs from a shallow capture: repeat its identical layers to full depth.

Capturing and annotating a 96-layer model takes minutes on a small machine, and its layers are
copies of one another: ``repeat_layers`` takes the chain of the same model built with a few
layers and lays out copies of them by a pattern (``repeat_last``: the last captured layer to full
depth; or, for a model with two kinds of layers, eight of the first and 24 of the second).
Blocks before and after the layers (the embedding, the head) are kept as they are; the copies'
parameters are renamed (``h.1.mlp.c_fc.weight`` -> ``h.57.mlp.c_fc.weight``) so that each layer
holds its own.

``RepeatedTable`` is a ``CostTable`` that does this to every chain another table gives.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from autopart.solve.chain_costs import ChainCosts

__all__ = ["NotLaidOut", "repeat_layers", "repeat_last", "RepeatedTable"]

_Figure = TypeVar("_Figure", int, bool)


class NotLaidOut(ValueError):
    """The captured chain's layers cannot be laid out to full depth: the list's layers are not one
    run of blocks (a forward that calls two lists' layers in turn); the caller costs the whole model."""

_INDEX = re.compile(r"^(.*)\.(\d+)$")


def repeat_last(captured: int, depth: int) -> tuple[int, ...]:
    """The pattern that keeps the captured layers and repeats the last one to ``depth`` layers."""
    if not 1 <= captured <= depth:
        raise ValueError(f"cannot make {depth} layers from {captured} captured")
    return (*range(captured - 1), *(captured - 1,) * (depth - captured + 1))


def repeat_layers(costs: ChainCosts, layers: Sequence[str | None],
                  pattern: Sequence[int]) -> tuple[ChainCosts, list[str | None]]:
    """The chain whose layer ``i`` is a copy of captured layer ``pattern[i]``, with the blocks
    before and after the layers as captured; and the new chain's layer per block.

    A copy costs what the captured layer costs, block for block; what crosses into it is what
    crossed into the captured one; its parameters are renamed to its place (``h.57.attn...``)."""
    order = list(dict.fromkeys(layer for layer in layers if layer is not None))
    if not order:
        raise ValueError("the chain has no repeated layers")
    if any(not 0 <= c < len(order) for c in pattern) or not pattern:
        raise ValueError(f"the pattern names layers 0..{len(order) - 1} of the capture, at least one")
    blocks_of = {layer: [k for k, x in enumerate(layers) if x == layer] for layer in order}
    spans = [(blocks_of[x][0], blocks_of[x][-1]) for x in order]
    if any(b - a + 1 != len(blocks_of[x]) for (a, b), x in zip(spans, order)) \
            or any(spans[i][1] + 1 != spans[i + 1][0] for i in range(len(spans) - 1)):
        raise NotLaidOut("the captured layers are not contiguous runs of blocks next to one another")
    head_first, tail_first = spans[0][0], spans[-1][1] + 1
    prefix = _split(order[0])[0]

    source: list[int] = list(range(head_first))  # per new block, the captured block it copies
    new_layers: list[str | None] = list(layers[:head_first])
    renames: list[dict[str, str]] = [{} for _ in range(head_first)]
    # per new boundary, the captured boundary it copies (-1: the batch inputs, which nothing gathers)
    crossed: list[int] = list(range(max(head_first - 1, 0)))
    for i, c in enumerate(pattern):
        first, last = spans[c]
        mapping = {order[c]: f"{prefix}.{i}"}
        if source:
            crossed.append(first - 1)
        for k in range(first, last + 1):
            source.append(k)
            new_layers.append(mapping[order[c]])
            renames.append({p: _renamed(p, mapping) for p in (*costs.block_parameters[k], *_buffers(costs, k))})
            if k < last:
                crossed.append(k)
    for k in range(tail_first, len(costs)):
        crossed.append(k - 1)
        source.append(k)
        new_layers.append(layers[k])
        renames.append({})
    assert len(crossed) == len(source) - 1

    block_parameters = tuple(
        tuple(rename.get(p, p) for p in costs.block_parameters[k]) for k, rename in zip(source, renames)
    )
    names = {p for ps in block_parameters for p in ps}
    parameter_bytes, parameter_state_bytes = {}, {}
    for k, rename in zip(source, renames):
        for p in costs.block_parameters[k]:
            new = rename.get(p, p)
            parameter_bytes[new] = costs.parameter_bytes[p]
            parameter_state_bytes[new] = costs.parameter_state_bytes[p]
    assert names == set(parameter_bytes)

    def renamed(names: frozenset[str]) -> frozenset[str]:
        return frozenset(rename.get(p, p) for k, rename in zip(source, renames) for p in costs.block_parameters[k] if p in names)

    def pick(values):
        return tuple(values[k] for k in source) if values else ()

    return ChainCosts(
        forward_s=pick(costs.forward_s),
        backward_s=pick(costs.backward_s),
        weight_s=pick(costs.weight_s),
        saved_bytes=pick(costs.saved_bytes), selective_saved_bytes=pick(costs.selective_saved_bytes),
        selective_recompute_s=pick(costs.selective_recompute_s), weight_seed_bytes=pick(costs.weight_seed_bytes),
        boundary_bytes=_crossing(costs.boundary_bytes, crossed, costs.input_bytes),
        boundary_gathered_bytes=_crossing(costs.boundary_gathered_bytes or (0,) * len(costs.boundary_bytes), crossed, 0),
        boundary_gradients=_crossing(costs.boundary_gradients or (True,) * len(costs.boundary_bytes), crossed, True),
        input_bytes=costs.input_bytes, loss_working_bytes=costs.loss_working_bytes,
        parameter_bytes=parameter_bytes,
        parameter_state_bytes=parameter_state_bytes,
        block_parameters=block_parameters,
        layer_parameters=renamed(costs.layer_parameters), decayed_parameters=renamed(costs.decayed_parameters),
        frozen_parameters=renamed(costs.frozen_parameters),
        layer_bytes=costs.layer_bytes,  # every layer a copy of a captured one
        layer_spans=_copied_spans(costs.layer_spans, spans, pattern, head_first),
        **_renamed_buffers(costs, source, renames),
    ), new_layers


def _crossing(values: tuple[_Figure, ...], crossed: list[int], batch: _Figure) -> tuple[_Figure, ...]:
    """A per-boundary figure at the copies' boundaries, each its captured boundary's (``batch``
    where the batch inputs cross: -1; a chain of one block has no boundary but those). There,
    between two copies, the first copy's output crosses: a gradient comes back over it (``True``)
    as over a trained layer's, though the batch itself takes none."""
    return tuple(values[k] if k >= 0 else batch for k in crossed)


def _copied_spans(layer_spans, spans, pattern, head_first: int) -> tuple[tuple[int, int], ...]:
    """The repeated layers' blocks (first, end) in the new chain: each copy's, where the captured
    layer ``pattern[i]`` (blocks ``spans[c]``, first and last) held them."""
    found, base = [], head_first
    for c in pattern:
        first, last = spans[c]
        found += [(base + a - first, base + e - first) for a, e in layer_spans if first <= a and e <= last + 1]
        base += last - first + 1
    return tuple(found)


def _split(layer: str) -> tuple[str, int]:
    match = _INDEX.match(layer)
    if match is None:
        raise ValueError(f"layer {layer!r} does not end in an index")
    return match.group(1), int(match.group(2))


def _renamed(parameter: str, mapping: dict[str, str]) -> str:
    for old, new in mapping.items():
        if parameter.startswith(old + "."):
            return new + parameter[len(old):]
    return parameter  # a weight shared with blocks outside the layer keeps its name


@dataclass
class RepeatedTable:
    """A ``CostTable`` whose chains are ``inner``'s with their layers laid out by ``pattern``.

    ``layers_of(micro_batch_size, tp, dtype)`` gives the inner chain's layer per block."""

    inner: object  # a CostTable
    layers_of: object  # Callable[[int, int, str], Sequence[str | None]]
    pattern: tuple[int, ...]
    _cache: dict = field(default_factory=dict, repr=False)

    def _repeated(self, micro_batch_size: int, tp: int, dtype: str) -> tuple[ChainCosts, list[str | None]]:
        key = (micro_batch_size, tp, dtype)
        if key not in self._cache:
            costs = self.inner.chain_costs(micro_batch_size=micro_batch_size, tp=tp, dtype=dtype)
            self._cache[key] = repeat_layers(costs, self.layers_of(micro_batch_size, tp, dtype), self.pattern)
        return self._cache[key]

    def chain_costs(self, *, micro_batch_size: int, tp: int, dtype: str) -> ChainCosts:
        return self._repeated(micro_batch_size, tp, dtype)[0]

    def block_layers(self, *, micro_batch_size: int, tp: int, dtype: str) -> list[str | None]:
        return self._repeated(micro_batch_size, tp, dtype)[1]

    def optimistic_costs(self, *, micro_batch_size: int, tp: int, dtype: str) -> ChainCosts:
        """``inner``'s optimistic costs (``autopart.solve.layout_bounds``) laid out by the pattern; its
        exact costs where it has none."""
        key = ("optimistic", micro_batch_size, tp, dtype)
        if key not in self._cache:
            optimistic = getattr(self.inner, "optimistic_costs", self.inner.chain_costs)
            costs = optimistic(micro_batch_size=micro_batch_size, tp=tp, dtype=dtype)
            self._cache[key] = repeat_layers(costs, self.layers_of(micro_batch_size, tp, dtype), self.pattern)
        return self._cache[key][0]

    def state_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32", layered: bool = False,
                    frozen: bool = False) -> int:
        return self.inner.state_bytes(parameter_bytes, dp=dp, zero=zero, dtype=dtype, layered=layered, frozen=frozen)

    def owned_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32",
                    frozen: bool = False) -> int:
        return self.inner.owned_bytes(parameter_bytes, dp=dp, zero=zero, dtype=dtype, frozen=frozen)


def _renamed_buffers(costs: ChainCosts, source: list[int], renames: list[dict[str, str]]) -> dict:
    """``ChainCosts``' buffer fields of the repeated chain: a layer's own buffers renamed with its
    parameters, one that every layer reads (rotary tables) shared as it was."""
    if not costs.block_buffers:
        return {}
    return {"block_buffers": tuple(tuple(rename.get(b, b) for b in costs.block_buffers[k])
                                   for k, rename in zip(source, renames)),
            "buffer_bytes": {rename.get(b, b): costs.buffer_bytes[b] for k, rename in zip(source, renames)
                             for b in costs.block_buffers[k]}}


def _buffers(costs: ChainCosts, k: int) -> tuple[str, ...]:
    """The buffers block ``k`` reads; none where the costs list none."""
    return costs.block_buffers[k] if costs.block_buffers else ()
