"""Layouts in the order of their lower bound, costing a layout's chain only when it may be needed.

The search (``autopart.solve.search``) visits layouts in the order of a lower bound on their step
and stops once that bound passes the last finalist's. The bound reads the layout's chain costs,
and costing a chain at a tensor-parallel degree means solving the sharding of its blocks
(CP-SAT, the larger part of a search's time): ordering every layout by that bound first would
cost every (micro-batch size, degree) pair, though most layouts are never visited.

``lazy_order`` gives the same layouts in the same order, ``(bound, layout)`` ascending, but asks
each layout's exact bound only once an *early* bound of it, one that needs no sharding, is the
smallest left. An early bound never above the exact one keeps the order exact: a layout comes out
only when every layout with a smaller exact bound already has; and the caller's ``cutoff`` ends
the walk as soon as the smallest bound left, early or exact, reaches it, so no layout whose
exact bound is below the cutoff is missed.

``optimistic_costs`` makes the chain costs an early bound reads: each block's time at the floor
that ``autopart.solve.tensor.fastest_compute_s`` puts under any sharding of it, each parameter at
a ``tp``-th of its bytes (a sharded one holds exactly that, a replicated one more), and no saved
activations or layers in flight (a sharded block keeps about a ``tp``-th of its bytes, at times a
little less), so that its memory test (``may_fit``) refuses no layout that the exact one keeps.

The bounds take a collective to take no less time on more bytes (the roofline's formula; measured
curves are clamped so: ``cost_models.comm_profile``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from autopart.predict.in_flight import in_flight, rank_in_flight
from autopart.predict.memory import layers_in_flight_bytes
from autopart.schedule import SPLIT_BACKWARD_KINDS, stage_placement
from autopart.solve.chain_costs import ChainCosts, stage_floor_s
from autopart.solve.rank_room import stages_by_rank
from autopart.solve.replica_shares import rank_spans
from autopart.solve.data_parallel_tail import FORWARD_SHARE, fully_sharded_floor_s, most_hidden_s, tail_s
from autopart.solve.transfers import boundary_transfer_s

__all__ = ["cut_within_owners", "early_bound", "layout_bound", "lazy_order", "may_fit", "mesh_overhead_bytes",
           "no_early_bound", "optimistic_costs", "stage_floor", "with_layout_state",
           "with_owners"]

Item = TypeVar("Item")


def lazy_order(items: Iterable[Item], *, exact: Callable[[Item], float], early: Callable[[Item], float],
               cutoff: Callable[[], float | None]) -> Iterator[tuple[float, Item]]:
    """``(exact(item), item)`` in ascending order (items must be orderable, to break ties), while
    the smallest bound left is below ``cutoff()`` (asked before each; None: no cutoff yet).
    ``early(item)`` must never exceed ``exact(item)`` (``-inf`` when nothing cheaper is known: the
    item is costed at once)."""
    heap: list[tuple[float, bool, Item]] = [(early(item), False, item) for item in items]
    heapq.heapify(heap)
    while heap:
        bound, is_exact, item = heap[0]
        limit = cutoff()
        if limit is not None and bound >= limit:
            return
        heapq.heappop(heap)
        if is_exact:
            yield bound, item
            continue
        value = exact(item)
        assert value >= bound, f"an early bound {bound} above the exact one {value} of {item}"
        heapq.heappush(heap, (value, True, item))


def optimistic_costs(costs: ChainCosts, floors: list[float], tp: int) -> ChainCosts:
    """``costs`` (the chain unsharded, as on one rank) with each block's time scaled down to its
    ``floors`` entry and each parameter, and what crosses each block boundary, at ``bytes // tp``:
    no sharding on ``tp`` ranks has a block faster or a share smaller (sequence parallelism holds
    and sends the residual stream's 1/tp, `autopart.passes.front.held_tensors`). Forward,
    backward and weight-gradient time scale together, as the sharded chain's do
    (``autopart.solve.front_table.chain_costs``), so the fraction of a block's time that is weight
    gradient is the same in both."""
    if len(floors) != len(costs):
        raise ValueError(f"{len(floors)} floors for a chain of {len(costs)} blocks")
    scales = [floor / (f + b) if f + b > 0 else 1.0 for floor, f, b in zip(floors, costs.forward_s, costs.backward_s)]
    share = {name: nbytes // tp for name, nbytes in costs.parameter_bytes.items()}
    return costs.changed(
        forward_s=tuple(f * s for f, s in zip(costs.forward_s, scales)),
        backward_s=tuple(b * s for b, s in zip(costs.backward_s, scales)),
        weight_s=tuple(w * s for w, s in zip(costs.weight_s, scales)),
        saved_bytes=(0,) * len(costs),  # a sharded block may keep a little under a tp-th of its bytes
        selective_saved_bytes=(0,) * len(costs),
        weight_seed_bytes=(),
        parameter_bytes=share,
        parameter_state_bytes=dict(share),
        boundary_bytes=tuple(b // tp for b in costs.boundary_bytes),  # no less than any rank sends
        boundary_gathered_bytes=(),  # nor any all-gather: none
        layer_bytes=0,  # no more than any sharding's largest layer (ZeRO-3 holds some in flight)
    )


def early_bound(table, cluster) -> Callable:
    """A floor under the search's bound ``layout_bound(table, layout, cluster)`` that needs no
    tensor-parallel sharding: the same bound on the table's ``optimistic_costs`` (every block at
    most as slow, every parameter share at most as large), with every gradient all-reduce that
    may hide behind the backward taken as hidden (the exact bound hides at most the part its
    stages' floors allow, and with smaller stages less). Every layout of a table without
    ``optimistic_costs`` is costed at once. zb-h1's bound is ``_zero_bubble_floor``'s, on the floor
    ``stage_floor(costs, layout, cluster)`` that ``layout_bound`` puts under each stage."""
    optimistic = getattr(table, "optimistic_costs", None)
    if optimistic is None:
        return no_early_bound
    class Optimistic:  # the table's optimistic costs in the place of its costs
        def chain_costs(self, *, micro_batch_size: int, tp: int, dtype: str) -> ChainCosts:
            return optimistic(micro_batch_size=micro_batch_size, tp=tp, dtype=dtype)

        def state_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32",
                        layered: bool = False, frozen: bool = False) -> int:
            return table.state_bytes(parameter_bytes, dp=dp, zero=zero, dtype=dtype, layered=layered, frozen=frozen)

    def early(layout) -> float:
        if layout.schedule != "zb-h1":
            return layout_bound(Optimistic(), layout, cluster, hides_all=True) * (1 - 1e-9)  # under the exact bound's rounding
        costs = optimistic(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
        # (no FSDP floor in it: zb-h1 never runs FSDP, ``fully_sharded_levels``, so its exact bound has none)
        plain = layout_bound(Optimistic(), dataclasses.replace(layout, schedule="1f1b"), cluster, hides_all=True)
        slowest = stage_floor(costs, layout, cluster)
        return _zero_bubble_floor(costs, layout.pp, layout.microbatches, plain, slowest) * (1 - 1e-9)

    return early


def _zero_bubble_floor(costs: ChainCosts, p: int, m: int, plain: float, slowest: float) -> float:
    """zb-h1's bound, ``total + X + (m - 1) S - 2 (p - 1) / p W + tail`` (X the transfers, S the
    slowest stage's floor ``slowest``, never below any block's time and never above a slower
    chain's; W the weight-gradient time), at its least over every chain whose blocks are at least
    as slow as ``costs``' with the same share of weight gradients each. ``plain``: 1f1b's bound of
    ``costs``, ``total + X + (m - 1) S + tail``.

    Per block k of time t and weight share r, the bound holds ``c t`` with ``c = 1 - 2 (p - 1) r / p``.
    Blocks with ``c >= 0`` only add as they slow; one with ``c < 0`` (an embedding, whose backward
    is all weight gradient) takes away at most ``|c| S``, since no block is slower than S. So the
    bound is at least ``sum_{c >= 0} c t + (m - 1 - sum_{c < 0} |c|) S + tail``, which grows with
    every block's time while the bracket is not negative (``-inf`` otherwise: no floor known). A
    block of no time here says nothing of its share: it counts as ``|c| = 1``, the most a weight
    gradient within its backward can give."""
    share = 2 * (p - 1) / p
    kept = lost = 0.0
    for f, b, w in zip(costs.forward_s, costs.backward_s, costs.weight_s):
        t = f + b
        if t > 0 and t >= share * w:
            kept += t - share * w
        elif t > 0:
            lost += share * w / t - 1
        else:
            lost += 1
    if m - 1 < lost:
        return -math.inf
    total = costs.prefix("compute_s")[-1]
    return plain - total + kept - lost * slowest


def no_early_bound(_item: object) -> float:
    """The early bound of a table that has no cheaper costs: every item is costed at once."""
    return -math.inf


def layout_bound(table, layout, cluster, *, slowest_s: float = 0.0, hides_all: bool = False,
                 memory: bool = True) -> float:
    """No cut or recompute makes ``layout``'s estimate (``autopart.solve.closed_form.estimate_step_s``)
    shorter: every stage at least ``stage_floor`` (or ``slowest_s``, where more) and every rank at
    least its share of the stages' least summed time, the stages' times summing to at least the
    compute, a transfer forward at every cut and its gradient back where one comes, zb-h1's
    smallest weight-gradient stage at most its share, FSDP's collectives (``fully_sharded_floor_s``),
    and the busiest rank holding at least its share of the parameters; infinite where no cuts fit
    (``may_fit``; not asked with ``memory`` False, where the caller holds cuts that fit).
    ``hides_all``: every all-reduce that may hide behind the backward taken as hidden."""
    costs = table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
    if memory and not may_fit(table, layout, cluster):
        return math.inf
    m, p = layout.microbatches, layout.pp
    transfer, gradient = cheapest_transfers_s(costs, layout, cluster)
    summed = costs.prefix("compute_s")[-1] + (layout.stages - 1) * (transfer + gradient)  # every stage's time, summed
    stage = max(stage_floor_s(costs, layout.stages, transfer, gradient), slowest_s)
    rank = max(summed / p, stage)  # its stages' time: an interleaved or V-shape rank holds several
    if layout.schedule == "zbv":  # its estimate is at least the busiest rank's m microbatches
        pipeline = m * rank
    elif layout.schedule == "interleaved":  # and the fill and drain, of the largest virtual stage
        pipeline = m * rank + (p - 1) * stage
    else:
        pipeline = summed + (m - 1) * stage
        if layout.schedule == "zb-h1":
            pipeline -= 2 * (p - 1) * sum(costs.weight_s) / p
    pipeline = max(pipeline, fully_sharded_floor_s(layout, costs, cluster))  # FSDP's collectives, per microbatch
    share = sum(costs.parameter_bytes.values()) // p
    # a rank's all-reduce hides behind its last backward, at most 2/3 of its stages' time: a longer
    # one adds more to the pipeline above (m - 1 >= 1 times, or m rounds) than it hides
    if hides_all:
        behind = math.inf
    elif m > 1 or layout.chunks > 1:
        behind = (1 - FORWARD_SHARE) * rank
    else:
        behind = most_hidden_s(layout, costs, cluster)
    # the busiest rank reduces and steps no less than an even share of what trains
    tail = tail_s(layout, cluster, [share], layout.data_parallel_span(cluster.gpus_per_node), [behind],
                  trained_bytes=[share * costs.trained_share],
                  pending_s=[0.0] if int(layout.zero) == 3 else None)  # ZeRO-3's: at least nothing
    return (pipeline + tail) * (1 - 1e-12)  # below the estimate's own rounding


def cheapest_transfers_s(costs: ChainCosts, layout, cluster) -> tuple[float, float]:
    """The least one transfer between two of ``layout``'s stages takes, and the least its gradient
    back takes (none over a boundary that takes none, `ChainCosts.gradient_transfer_s`); 0 with one stage."""
    if layout.stages == 1 or not costs.boundary_bytes:
        return 0.0, 0.0
    transfers = boundary_transfer_s(costs, layout, cluster)
    return min(transfers), min(costs.gradient_transfer_s(transfers))


def stage_floor(costs: ChainCosts, layout, cluster) -> float:
    """``stage_floor_s`` of ``costs`` cut into ``layout``'s stages on ``cluster``'s links."""
    return stage_floor_s(costs, layout.stages, *cheapest_transfers_s(costs, layout, cluster))


def with_layout_state(table, layout) -> ChainCosts:
    """``layout``'s chain costs with each parameter's state at its data-parallel degree and ZeRO
    level, and full recompute layer by layer where its schedule's backward is whole (else the
    weight-gradient seeds its split backward keeps)."""
    costs = table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
    costs.shared_parameters  # noqa: B018 - computed once on the table's costs, carried to each layout's
    costs = costs.with_state(_layout_state(table, layout), key=_state_key(layout))
    return costs.splitting_backward() if layout.schedule in SPLIT_BACKWARD_KINDS else costs.checkpointing_layers()


def _state_key(layout) -> tuple:
    """What ``_layout_state`` depends on besides the table: it names that function to the costs' caches."""
    return layout.dp, layout.zero, layout.dtype


def _layout_state(table, layout) -> Callable[..., int]:
    """The state bytes of a parameter's bytes at ``layout``'s data-parallel degree, ZeRO level and dtype."""
    return functools.partial(table.state_bytes, dp=layout.dp, zero=layout.zero, dtype=layout.dtype)


def with_owners(cut, excess: Callable[[tuple[tuple[int, int], ...]], int] | None, *, blocks: int,
                ranks: tuple[int, ...], memory_limit_bytes: int):
    """``cut`` (a `StageCut` of a chain of ``blocks``) with each rank's
    `autopart.solve.replica_shares.owners_beyond_shares` in its memory; None where a rank then
    breaks the limit."""
    if cut is None or excess is None:
        return cut
    spans = rank_spans(cut.cuts, blocks, ranks)
    memory = tuple(nbytes + excess(mine) for nbytes, mine in zip(cut.rank_memory_bytes, spans))
    return dataclasses.replace(cut, rank_memory_bytes=memory) if max(memory) <= memory_limit_bytes else None


def cut_within_owners(cutter: Callable[[int], Any], excess: Callable[[tuple[tuple[int, int], ...]], int] | None, *,
                      blocks: int, ranks: tuple[int, ...], memory_limit_bytes: int):
    """``cutter(memory_limit_bytes)``'s cuts (a `StageCut` or None); where ZeRO-1's owners
    (`autopart.solve.replica_shares.owners_beyond_shares`), which the cutter's running sums leave
    out, make them break the limit, its cuts within what the owners of those cuts leave of it (the
    first where it finds none there: the refinement, which counts the owners, may still move them
    into the limit)."""
    cut = cutter(memory_limit_bytes)
    if excess is None or cut is None or with_owners(cut, excess, blocks=blocks, ranks=ranks,
                                                    memory_limit_bytes=memory_limit_bytes) is not None:
        return cut
    return cutter(memory_limit_bytes - max(excess(spans) for spans in rank_spans(cut.cuts, blocks, ranks))) or cut


def mesh_overhead_bytes(layout, costs: ChainCosts, cluster) -> int:
    """Per rank, what ``layout``'s mesh holds besides its stages: the framework's, the collective
    library's buffers, and at ZeRO-3 the gathered layers in flight."""
    return (cluster.overhead_bytes + cluster.communicator_bytes(layout.pp, layout.tp, layout.dp, layout.schedule)
            + layers_in_flight_bytes(costs.layer_bytes, dp=layout.dp, zero=int(layout.zero)))


def may_fit(table, layout, cluster) -> bool:
    """False where no cuts of ``layout`` fit in memory, by what every rank holds at the least,
    whatever the cuts and recompute: the state of the parameters its stages read (together, each
    parameter once: ``autopart.solve.bottleneck.cut_stages``'s first test) and per microbatch in
    flight, per stage, the least it keeps of one (``_least_kept``), at the rank's fullest moment
    (``autopart.predict.in_flight``). The moments of a rank of several stages take long to list
    for long pipelines: they are asked only where each stage at its own peak leaves room."""
    costs = table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
    if layout.stages > len(costs):
        return False  # a stage without a block: ``cut_stages`` refuses it
    room = cluster.memory_bytes - mesh_overhead_bytes(layout, costs, cluster)
    parameters = costs.state_bytes_total(_layout_state(table, layout), key=_state_key(layout))
    if room <= 0 or parameters > layout.pp * room:
        return False
    kept = _least_kept(costs, layout.stages)

    def fits(held: list[int]) -> bool:  # per rank, the bytes its stages keep in flight at the least
        return max(held) <= room and sum(held) + parameters <= layout.pp * room

    key = (layout.schedule, layout.pp, layout.microbatches, layout.chunks)
    mine = _stages_by_rank(layout.schedule, layout.pp, layout.chunks)
    peaks = in_flight(*key)  # each stage at its own peak first, which one of its rank's moments holds
    alone = [max(peaks[s] * kept[s] for s in stages) for stages in mine]
    if layout.chunks == 1 or not fits(alone):
        return fits(alone)
    return fits([max(sum(count * kept[s] for count, s in zip(moment, stages)) for moment in moments)
                 for stages, moments in zip(mine, rank_in_flight(*key))])  # then its stages together, at each moment


@functools.lru_cache(maxsize=1024)
def _stages_by_rank(schedule: str, pp: int, chunks: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, the stages the schedule places there (the search asks per layout: kept, so not lists)."""
    return tuple(map(tuple, stages_by_rank(stage_placement(schedule, ranks=pp, chunks=chunks))))


def _least_kept(costs: ChainCosts, stages: int) -> list[int]:
    """Per stage of ``stages``, the fewest bytes it keeps per microbatch in flight under any cuts
    and recompute: stage s holds blocks s to blocks - stages + s at most (every stage holds one),
    and keeps what one of them saves, without recompute, or with it what crosses a boundary at
    the least (a stage's input, a layer's under full recompute)."""
    return costs.kept(("least_kept", stages), lambda: _least_kept_of(costs, stages))


def _least_kept_of(costs: ChainCosts, stages: int) -> list[int]:
    saved, blocks = costs.saved_bytes, len(costs)
    width = blocks - stages + 1
    window: collections.deque[int] = collections.deque()  # indices of a running minimum of saved
    least = []
    for k in range(blocks):
        while window and saved[window[-1]] >= saved[k]:
            window.pop()
        window.append(k)
        if window[0] <= k - width:
            window.popleft()
        if k >= width - 1:
            least.append(saved[window[0]])
    # at the least, with recompute: what crosses a boundary, as a rank holds it
    received = min(costs.boundary_bytes, default=0)
    return [min(least[s], costs.input_bytes if s == 0 else received) for s in range(stages)]
