"""What the pipeline cutters know of a chain of blocks: per block, one microbatch's times, the
bytes it keeps and sends, and the parameters it reads (``ChainCosts``), with running sums over
them so that any stage's figures (``stage_figures``) cost a few subtractions: the search asks
for millions. Built from the annotated chain by ``autopart.solve.front_table`` (and from a table of
stages by ``autopart.solve.fitting``); it knows nothing of devices."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

__all__ = ["ChainCosts", "StageFigures", "chain_sums", "stage_figures", "stage_floor_s"]

_T = TypeVar("_T")
Kind = tuple[int, bool, bool]
"""A parameter's kind, all that its state depends on: its bytes, a repeated layer's own, frozen."""


@dataclass(frozen=True, kw_only=True)
class ChainCosts:
    """One microbatch through each block on one rank, after tensor-parallel sharding."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]  # input and weight gradients together
    weight_s: tuple[float, ...]  # the weight-gradient part of backward_s
    saved_bytes: tuple[int, ...]  # kept for backward without recompute
    selective_saved_bytes: tuple[int, ...]  # kept under selective recompute
    selective_recompute_s: tuple[float, ...]  # forward work selective recompute repeats in backward
    # what crosses after block k as one rank holds it (`autopart.passes.front.boundary_held_bytes`:
    # the residual stream's slice under sequence parallelism); len = blocks - 1
    boundary_bytes: tuple[int, ...]
    # of those, per boundary, the replicated tensors that travel in tensor-parallel parts and are
    # all-gathered on arrival (`autopart.ir.scatter_gather.gathered`); () where there are none
    boundary_gathered_bytes: tuple[int, ...] = ()
    # per boundary, whether a gradient comes back across it: some value crossing it needs one
    # (`autopart.ir.plan.gradient_boundaries`, the rule the plan, the step model and the runtime
    # follow); () where one comes back across every boundary
    boundary_gradients: tuple[bool, ...] = ()
    input_bytes: int  # the batch inputs (token ids, targets) a stage may read, per microbatch
    parameter_bytes: dict[str, int]  # per parameter, its share on one rank of the tensor-parallel group
    parameter_state_bytes: dict[str, int]  # the same with gradients and optimizer state
    block_parameters: tuple[tuple[str, ...], ...]
    layer_parameters: frozenset[str] = frozenset()  # a repeated layer's own: its own FSDP unit at ZeRO-3
    frozen_parameters: frozenset[str] = frozenset()  # requires_grad=False in the model: weights alone, no state
    layer_bytes: int = 0  # the largest repeated layer's ``parameter_bytes`` (``autopart.predict.memory``)
    layer_spans: tuple[tuple[int, int], ...] = ()  # each repeated layer's blocks (first, end), in chain order
    # per block, what the parameters first read there cost more where a cut splits their layer
    # (ZeRO-3: they run in the stages' root units, not the layer's own); () where nothing does
    split_layer_bytes: tuple[int, ...] = ()
    # full recompute checkpoints each layer a stage holds whole by itself (a whole backward,
    # `autopart.passes.recompute`); False: it checkpoints the stage (a split backward)
    layer_by_layer: bool = False
    # what the loss's backward holds besides, on the last block's stage (`autopart.passes.front.loss_working_bytes`)
    loss_working_bytes: int = 0
    # per block, what a split backward's I keeps for its W (`autopart.passes.weight_seeds`); () where nothing
    weight_seed_bytes: tuple[int, ...] = ()
    # the backward is split (zero-bubble): a stage holds its seeds for as many microbatches as its
    # recompute rebuilds at once (both live from I to W), but the first, which keeps its whole graph instead
    split_backward: bool = False
    # the parameters weight decay applies to, in the optimizer's first group (`autopart.runtime.recipe`):
    # ZeRO-1 partitions fp32 groups in turn (`autopart.predict.memory.optimizer_group`)
    decayed_parameters: frozenset[str] = frozenset()
    # per buffer, what a stage that reads it holds for it (`autopart.predict.memory.held_buffer_bytes`,
    # whatever the layout), and per block the buffers it reads; () where there are none. A stage
    # holds its blocks' buffers beside its parameters' state: ``owned_state_bytes`` counts both
    buffer_bytes: dict[str, int] = field(default_factory=dict)
    block_buffers: tuple[tuple[str, ...], ...] = ()
    # what is made from these figures and kept with them: the running sums (`prefix`) and all `kept` keeps
    _kept: dict = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.forward_s)

    def prefix(self, name: str) -> list[float]:
        """Running sums of a per-block figure: ``prefix(x)[j] = sum(x[:j])``."""
        return self.kept(name, lambda: [0, *itertools.accumulate(self._per_block(name))])

    def _per_block(self, name: str) -> Iterable[float]:
        """The per-block figure that ``prefix(name)`` sums: a field, or one made from them."""
        if name == "owned_state_bytes":
            return self._owned_state_bytes()
        if name == "owned_weight_bytes":  # the parameters alone, one tensor-parallel rank's share
            return [sum(size * count for (size, _, _), count in sizes) for sizes in self._owned_sizes()]
        if name == "owned_layer_bytes":  # of those, the repeated layers' own (their ZeRO-3 units)
            return [sum(size * count for (size, layered, _), count in sizes if layered) for sizes in self._owned_sizes()]
        if name == "full_recompute_s":
            return self.forward_s
        if name == "compute_s":
            return [f + b for f, b in zip(self.forward_s, self.backward_s)]
        return getattr(self, name)

    def kept(self, key: Hashable, make: Callable[[], _T]) -> _T:
        """``make()``, made once for these costs under ``key`` and kept with them: what depends on
        the chain alone (and on what ``key`` names), which the search asks again for every layout
        it bounds and cuts. ``key``: hashable, a tuple led by what it is (``("least_kept", n)``),
        apart from the names these costs keep themselves under. What is kept is carried to
        `checkpointing_layers`' copy: it must not depend on ``layer_by_layer``."""
        found = self._kept.get(key)
        if found is None:
            found = self._kept[key] = make()
        return found

    def gradient_transfer_s(self, transfer_s: tuple[float, ...]) -> tuple[float, ...]:
        """Per boundary, the seconds of the gradient message back across it, of one whose
        activations take ``transfer_s`` (per boundary) forward: none where no gradient comes back
        (`boundary_gradients`: behind a frozen prefix the runtime sends none, and a cut there
        costs the stage after it no gradient to send)."""
        if not self.boundary_gradients:
            return transfer_s
        return tuple(t if back else 0.0 for t, back in zip(transfer_s, self.boundary_gradients, strict=True))

    def changed(self, **changes: Any) -> ChainCosts:
        """A copy with ``changes``, keeping none of these costs' kept figures (they read what changed)."""
        return replace(self, **changes, _kept={})

    @property
    def trained_share(self) -> float:
        """Of the parameter bytes, the share that trains (1 with nothing frozen): the busiest rank
        reduces and steps at least this share of an even split of the bytes, as the search's bounds
        take it (its estimates count each rank's own, `autopart.solve.replica_shares.trained_bytes`)."""
        def made() -> float:
            total = sum(self.parameter_bytes.values())
            frozen = sum(self.parameter_bytes[p] for p in self.frozen_parameters if p in self.parameter_bytes)
            return 1.0 - frozen / total if total else 1.0

        return self.kept("trained_share", made)

    def largest_block_s(self) -> float:
        """The slowest block's forward and backward."""
        return self.kept("largest_block", lambda: max(f + b for f, b in zip(self.forward_s, self.backward_s)))

    def _owned_state_bytes(self) -> list[int]:
        """Each parameter's state counted at the first block that reads it, and each buffer's bytes."""
        owned = self._owned_buffer_bytes()
        seen: set[str] = set()
        for k, names in enumerate(self.block_parameters):
            for p in names:
                if p not in seen:
                    seen.add(p)
                    owned[k] += self.parameter_state_bytes[p]
        return owned

    def _owned_buffer_bytes(self) -> list[int]:
        """Per block, the held bytes of the buffers first read there."""
        def made() -> tuple[int, ...]:
            owned, seen = [0] * len(self), set()
            for k, names in enumerate(self.block_buffers):
                owned[k] = sum(self.buffer_bytes[b] for b in names if b not in seen)
                seen.update(names)
            return tuple(owned)

        return list(self.kept("owned_buffers", made))

    def _owned_sizes(self) -> list[tuple[tuple[Kind, int], ...]]:
        """Per block, ((parameter bytes, layered, frozen), how many) of the parameters first read there."""
        def made() -> list[tuple[tuple[Kind, int], ...]]:
            found, seen = [], set()
            for names in self.block_parameters:
                counts: dict[Kind, int] = {}
                for p in names:
                    if p not in seen:
                        seen.add(p)
                        kind = (self.parameter_bytes[p], p in self.layer_parameters, p in self.frozen_parameters)
                        counts[kind] = counts.get(kind, 0) + 1
                found.append(tuple(counts.items()))
            return found

        return self.kept("owned_sizes", made)

    def _kind(self, name: str) -> Kind:
        return self.parameter_bytes[name], name in self.layer_parameters, name in self.frozen_parameters

    def state_bytes_total(self, state_bytes: Callable[..., int], *, key: Hashable | None = None) -> int:
        """``with_state(state_bytes)``'s parameter state summed over the chain, each parameter
        once (``prefix("owned_state_bytes")[-1]``), without building those costs. ``key``
        names ``state_bytes`` as ``with_state``'s does: the total is kept under it."""
        if key is not None:
            kept = self._kept.setdefault("state_totals", {})
            if key not in kept:
                kept[key] = self.state_bytes_total(state_bytes)
            return kept[key]
        def made() -> dict[Kind, int]:
            kinds: dict[Kind, int] = {}
            for sizes in self._owned_sizes():
                for kind, count in sizes:
                    kinds[kind] = kinds.get(kind, 0) + count
            return kinds

        kinds = self.kept("owned_kinds", made)
        buffers = sum(self.buffer_bytes.values())
        return buffers + sum(state * kinds[kind] for kind, state in _state_by_kind(state_bytes, kinds).items())

    def checkpointing_layers(self) -> ChainCosts:
        """These costs with ``layer_by_layer`` set, made once and kept with them (what is kept with
        these that does not depend on it carried over: all but the running sums of `chain_sums`)."""
        if self.layer_by_layer:
            return self
        return self.kept("layer_by_layer", lambda: replace(self, layer_by_layer=True, _kept=self._unsummed()))

    def splitting_backward(self) -> ChainCosts:
        """These costs with ``split_backward`` set, made once and kept with them (as ``checkpointing_layers``)."""
        assert not self.layer_by_layer, "full recompute checkpoints layer by layer only where the backward is whole"
        if self.split_backward or not any(self.weight_seed_bytes):
            return self
        return self.kept("split_backward", lambda: replace(self, split_backward=True, _kept=self._unsummed()))

    def _unsummed(self) -> dict:
        """What is kept with these costs that a copy with another backward keeps too: all but the running sums."""
        return {k: v for k, v in self._kept.items() if k not in ("sums", "with_state", "layer_by_layer", "split_backward")}

    def with_state(self, state_bytes: Callable[..., int], *, key: Hashable | None = None) -> ChainCosts:
        """These costs with ``parameter_state_bytes[p] = state_bytes(parameter_bytes[p], layered=p in
        layer_parameters, frozen=p in frozen_parameters)``. Fast
        for chains of thousands of parameters: one call per distinct size, and the running sums
        that depend only on which block reads what are carried over. ``key`` names ``state_bytes``
        (the same key, the same function): the result is kept under it and given again, with the
        running sums it gathers, to every layout that shares these costs and that state."""
        if key is not None:
            kept = self._kept.setdefault("with_state", {})
            if key not in kept:
                kept[key] = self.with_state(state_bytes)
            return kept[key]
        kinds = {self._kind(p) for p in self.parameter_bytes}
        kinds |= {(size, False, frozen) for size, layered, frozen in kinds if layered}  # what a layer split by a cut costs
        state = _state_by_kind(state_bytes, kinds)
        owned = [buffers + sum(state[kind] * count for kind, count in sizes)
                 for sizes, buffers in zip(self._owned_sizes(), self._owned_buffer_bytes())]
        carried = {name: self._kept[name] for name in ("owned_sizes", "shared", "owned_buffers", "shared_buffers") if name in self._kept}
        carried["owned_state_bytes"] = [0, *itertools.accumulate(owned)]
        split = [sum((state[size, False, frozen] - state[size, True, frozen]) * count
                     for (size, layered, frozen), count in sizes if layered)
                 for sizes in self._owned_sizes()]
        return replace(self, parameter_state_bytes={p: state[self._kind(p)] for p in self.parameter_bytes},
                       split_layer_bytes=tuple(split) if any(split) else (),  # a layer unit holds less than a root
                       _kept=carried)

    @property
    def shared_parameters(self) -> dict[str, tuple[int, ...]]:
        """Parameters read by more than one block (tied embeddings), with the blocks that read them."""
        def made() -> dict[str, tuple[int, ...]]:
            readers: dict[str, list[int]] = {}
            for k, names in enumerate(self.block_parameters):
                for p in names:
                    readers.setdefault(p, []).append(k)
            return {p: tuple(ks) for p, ks in readers.items() if len(ks) > 1}

        return self.kept("shared", made)

    @property
    def shared_buffers(self) -> dict[str, tuple[int, ...]]:
        """Buffers read by more than one block (rotary tables that every layer reads), with the blocks that read them."""
        def made() -> dict[str, tuple[int, ...]]:
            readers: dict[str, list[int]] = {}
            for k, names in enumerate(self.block_buffers):
                for b in dict.fromkeys(names):
                    readers.setdefault(b, []).append(k)
            return {b: tuple(ks) for b, ks in readers.items() if len(ks) > 1}

        return self.kept("shared_buffers", made)


def _state_by_kind(state_bytes: Callable[..., int], kinds: Iterable[Kind]) -> dict[Kind, int]:
    """Per (parameter bytes, a repeated layer's own, frozen), the state ``state_bytes`` gives it
    (asked with those flags only where they are set: a plain ``state_bytes(nbytes)`` serves a chain
    that has neither)."""
    def state(size: int, layered: bool, frozen: bool) -> int:
        flags = {name: True for name, value in (("layered", layered), ("frozen", frozen)) if value}
        return state_bytes(size, **flags)

    return {kind: state(*kind) for kind in kinds}


@dataclass(frozen=True, kw_only=True)
class StageFigures:
    time_s: float
    weight_s: float
    memory_bytes: int
    parts: tuple[int, int, int] = (0, 0, 0)  # parameter bytes, bytes per microbatch in flight, bytes held once


def stage_figures(
    costs: ChainCosts, first: int, last: int, *, mode: str, in_flight: int, transfer_in_s: float, transfer_out_s: float,
    transient: int = 1,
) -> StageFigures:
    """Time and memory of the stage of blocks ``first..last`` under a recompute mode: the figures
    of ``autopart.passes.recompute.recompute_cost``. Recompute keeps the stage's arguments (what it
    receives, and the batch inputs, counted whole) per microbatch in flight, and the activations
    it rebuilds live while ``transient`` microbatches' backwards run."""
    compute_s, weight_s, parameters, per_microbatch, once = chain_sums(costs).parts(first, last, mode, transient)
    return StageFigures(time_s=compute_s + transfer_in_s + transfer_out_s, weight_s=weight_s,
                  memory_bytes=parameters + in_flight * per_microbatch + once, parts=(parameters, per_microbatch, once))


class _Sums:
    """A chain's running sums, held in one place: the search evaluates millions of stages."""

    __slots__ = ("compute", "repeated", "saved", "selective_saved", "owned", "weight", "received",
                 "shared", "read_again_from", "split", "span", "layers", "loss", "blocks", "seeds")

    def __init__(self, costs: ChainCosts):
        p = costs.prefix
        self.compute, self.weight, self.owned = p("compute_s"), p("weight_s"), p("owned_state_bytes")
        # per recompute mode, the running sums of the forward work its backward repeats
        self.repeated = {"none": None, "selective": p("selective_recompute_s"), "full": p("full_recompute_s"),
                         "stage": p("full_recompute_s")}
        self.saved, self.selective_saved = p("saved_bytes"), p("selective_saved_bytes")
        # what a stage from block ``first`` keeps per microbatch to recompute from: [first]
        self.received = tuple(b + costs.input_bytes for b in (0, *costs.boundary_bytes))
        self.shared = tuple((readers, costs.parameter_state_bytes[name])
                            for name, readers in costs.shared_parameters.items())
        self.shared += tuple((readers, costs.buffer_bytes[name]) for name, readers in costs.shared_buffers.items())
        # no block before this one reads a weight that an earlier block read first: a stage that
        # ends before it holds its blocks' own parameters alone (a tied embedding's is the last)
        self.read_again_from = min((readers[1] for readers, _ in self.shared), default=math.inf)
        # A repeated layer that a cut splits is written inline in both stages and runs in their
        # root units (`autopart.codegen.layers`): its parameters cost what a root's do, not a
        # layer unit's shards. Per block, the layer it is in (first, end); ``split``: running sums
        # of what that costs more, where it does (ZeRO-3's ``with_state``).
        self.split = costs.prefix("split_layer_bytes") if costs.split_layer_bytes else None
        span = [(k, k + 1) for k in range(len(costs))]
        for first, end in costs.layer_spans:
            span[first:end] = [(first, end)] * (end - first)
        self.span = tuple(span)
        self.layers = _LayerSums(costs, self.span) if costs.layer_by_layer and costs.layer_spans else None
        self.loss, self.blocks = costs.loss_working_bytes, len(costs)
        self.seeds = p("weight_seed_bytes") if costs.split_backward else None

    def stage(self, first: int, last: int, mode: str, in_flight: int, transfer_in_s: float,
              transfer_out_s: float, transient: int = 1) -> tuple[float, float, int]:
        """(time, weight-gradient time, memory) of blocks ``first..last``: see ``stage_figures``."""
        compute, weight, parameters, per_microbatch, once = self.parts(first, last, mode, transient)
        return compute + transfer_in_s + transfer_out_s, weight, parameters + in_flight * per_microbatch + once

    def seconds(self, first: int, last: int, mode: str) -> float:
        """``parts``' first figure alone: compute and recompute seconds of blocks ``first..last``."""
        if mode not in self.repeated:
            raise ValueError(f"unknown recompute mode {mode!r}")
        end, repeated = last + 1, self.repeated[mode]
        compute = self.compute[end] - self.compute[first]
        if mode == "full" and self.layers is not None and self.layers.whole(first, last):
            return compute + self.layers.again(first, last)
        return compute if repeated is None else compute + (repeated[end] - repeated[first])

    def parts(self, first: int, last: int, mode: str, transient: int = 1) -> tuple[float, float, int, int, int]:
        """(compute and recompute seconds, weight-gradient seconds, parameter bytes, bytes per
        microbatch in flight, bytes held once) of blocks ``first..last`` under ``mode``."""
        end = last + 1
        return (self.seconds(first, last, mode), self.weight[end] - self.weight[first], self.parameters(first, last),
                *self.held(first, last, mode, transient))

    def held(self, first: int, last: int, mode: str, transient: int = 1) -> tuple[int, int]:
        """``parts``' activations alone: (bytes per microbatch in flight, bytes held once; the last
        stage's holds the loss's backward too, and under a split backward every stage but the first
        the seeds of ``transient`` microbatches' W)."""
        per_microbatch, once = self._held(first, last, mode, transient)
        if self.seeds is not None and first > 0:
            once += transient * (self.seeds[last + 1] - self.seeds[first])
        return per_microbatch, once + (self.loss if last == self.blocks - 1 else 0)

    def _held(self, first: int, last: int, mode: str, transient: int) -> tuple[int, int]:
        end = last + 1
        saved_none = self.saved[end] - self.saved[first]
        if mode == "none":
            return saved_none, 0
        if mode == "selective":
            selective = self.selective_saved[end] - self.selective_saved[first]
            return self.received[first] + selective, transient * max(0, saved_none - selective)
        if mode == "full" and self.layers is not None and self.layers.whole(first, last):
            return self.layers.held(first, last), transient * self.layers.largest
        if mode in ("full", "stage"):
            return self.received[first], transient * saved_none
        raise ValueError(f"unknown recompute mode {mode!r}")

    def parameters(self, first: int, last: int) -> int:
        """``parts``' parameter bytes alone (in any mode): the state of the parameters first read
        in blocks ``first..last``, a layer a cut splits at what its root units hold, and a weight
        read before the stage and again in it; the stage's buffers alike."""
        end = last + 1
        parameters = self.owned[end] - self.owned[first]
        if self.split is not None:
            begin, stop = self.span[first]
            if begin < first:  # a layer begun in the stage before
                parameters += self.split[min(stop, end)] - self.split[first]
            begin, stop = self.span[last]
            if stop > end and begin >= first:  # a layer the next stage ends
                parameters += self.split[end] - self.split[begin]
        if last < self.read_again_from:
            return parameters
        for readers, nbytes in self.shared:  # a weight first read before the stage, read again in it
            if readers[0] < first:
                k = bisect.bisect_left(readers, first)
                if k < len(readers) and readers[k] <= last:
                    parameters += nbytes
        return parameters


class _LayerSums:
    """Full recompute layer by layer: running sums of what a stage keeps and runs again. A layer
    the stage holds whole keeps what enters it (its first block, the boundary before it) and runs
    its forward again; a block outside the layers, or in a layer a cut splits (written inline,
    `autopart.codegen.layers`), keeps what it saves without recompute. The backward rebuilds one
    layer at a time: ``largest``, the most any layer saves."""

    __slots__ = ("saved", "kept", "forward", "starts", "span", "largest")

    def __init__(self, costs: ChainCosts, span: tuple[tuple[int, int], ...]):
        inside = [False] * len(costs)  # a layer may be one block, whose span is a plain block's
        for first, end in costs.layer_spans:
            inside[first:end] = [True] * (end - first)
        starts = [inside[k] and span[k][0] == k for k in range(len(costs))]
        entering = (0, *costs.boundary_bytes)  # what a layer keeps under full recompute: what enters it, as held
        kept = [(entering[k] if starts[k] else 0) if inside[k] else costs.saved_bytes[k] for k in range(len(costs))]
        self.saved = costs.prefix("saved_bytes")
        self.kept = [0, *itertools.accumulate(kept)]
        self.forward = [0, *itertools.accumulate(f if i else 0.0 for f, i in zip(costs.forward_s, inside))]
        self.starts = [0, *itertools.accumulate(starts)]
        self.span = span
        self.largest = max(self.saved[end] - self.saved[first] for first, end in costs.layer_spans)

    def _cut(self, first: int, last: int) -> list[tuple[int, int]]:
        """The blocks of ``first..last`` in layers that the stage's edges split: written inline."""
        end, cut = last + 1, []
        begin, stop = self.span[first]
        if begin < first:  # a layer begun in the stage before
            cut.append((first, min(stop, end)))
        begin, stop = self.span[last]
        if stop > end and begin >= first:  # a layer the next stage ends
            cut.append((begin, end))
        return cut

    def whole(self, first: int, last: int) -> int:
        """How many layers the stage holds whole (none: the stage checkpoints whole)."""
        begin, stop = self.span[last]
        partial_at_end = stop > last + 1 and begin >= first  # a plain block's span ends with it
        return self.starts[last + 1] - self.starts[first] - partial_at_end

    def held(self, first: int, last: int) -> int:
        """Bytes per microbatch in flight."""
        held = self.kept[last + 1] - self.kept[first]
        for a, b in self._cut(first, last):
            held += (self.saved[b] - self.saved[a]) - (self.kept[b] - self.kept[a])
        return held

    def again(self, first: int, last: int) -> float:
        """Forward seconds the backward runs again: the whole layers'."""
        again = self.forward[last + 1] - self.forward[first]
        return again - sum(self.forward[b] - self.forward[a] for a, b in self._cut(first, last))


def chain_sums(costs: ChainCosts) -> _Sums:
    """The running sums of ``costs``, made once and kept with them."""
    return costs.kept("sums", lambda: _Sums(costs))


def stage_floor_s(costs: ChainCosts, stages: int, transfer_s: float = 0.0, gradient_s: float | None = None) -> float:
    """No cuts of ``costs`` into ``stages`` stages make the slowest stage faster than this, where
    no transfer between stages takes less than ``transfer_s`` (one way) and no gradient back less
    than ``gradient_s`` (``transfer_s`` where not given; 0 where some boundary takes none). Each
    cut adds a transfer to the stage before it and a gradient to the one after, so the stages'
    times sum to at least the compute and (stages - 1) of each; some stage holds the largest
    block, and some stage holds at least ceil(blocks / stages) blocks (pigeonhole), so at least
    the cheapest run of that many; each of those, with a message at one end at least."""
    gradient_s = transfer_s if gradient_s is None else gradient_s
    blocks = len(costs)
    compute = costs.prefix("compute_s")
    if stages <= 1 or blocks == 0:
        return compute[-1]
    fewest = -(-blocks // stages)
    cheapest = costs.kept(("cheapest_run", fewest),
                          lambda: min(compute[k + fewest] - compute[k] for k in range(blocks - fewest + 1)))
    return max((compute[-1] + (stages - 1) * (transfer_s + gradient_s)) / stages,
               max(costs.largest_block_s(), cheapest) + min(transfer_s, gradient_s))
