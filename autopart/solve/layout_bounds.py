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
a ``tp``-th of its bytes (a sharded one holds exactly that, a replicated one more).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from autopart.solve.chain_costs import ChainCosts

__all__ = ["early_bound", "lazy_order", "no_early_bound", "optimistic_costs"]

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
    ``floors`` entry and each parameter at ``bytes // tp``: no sharding on ``tp`` ranks has a block
    faster or a parameter share smaller. Forward, backward and weight-gradient time scale together,
    as the sharded chain's do (``autopart.solve.planner.chain_costs``), so the fraction of a block's
    time that is weight gradient is the same in both."""
    if len(floors) != len(costs):
        raise ValueError(f"{len(floors)} floors for a chain of {len(costs)} blocks")
    scales = [floor / (f + b) if f + b > 0 else 1.0 for floor, f, b in zip(floors, costs.forward_s, costs.backward_s)]
    share = {name: nbytes // tp for name, nbytes in costs.parameter_bytes.items()}
    return dataclasses.replace(
        costs,
        forward_s=tuple(f * s for f, s in zip(costs.forward_s, scales)),
        backward_s=tuple(b * s for b, s in zip(costs.backward_s, scales)),
        weight_s=tuple(w * s for w, s in zip(costs.weight_s, scales)),
        parameter_bytes=share,
        parameter_state_bytes=dict(share),
        layer_bytes=0,  # no more than any sharding's largest layer (ZeRO-3 holds some in flight)
        _prefix={},
    )


def early_bound(table, cluster, lower_bound: Callable, stage_floor: Callable) -> Callable:
    """A floor under the search's bound ``lower_bound(table, layout, cluster)`` that needs no
    tensor-parallel sharding: the same bound on the table's ``optimistic_costs`` (every block at
    most as slow, every parameter share at most as large), with every gradient all-reduce that
    may hide behind the backward taken as hidden (the exact bound hides at most the part its
    stages' floors allow, and with smaller stages less). Every layout of a table without
    ``optimistic_costs`` is costed at once. zb-h1's bound is ``_zero_bubble_floor``'s, on the floor
    ``stage_floor(costs, layout, cluster)`` that ``lower_bound`` puts under each stage."""
    optimistic = getattr(table, "optimistic_costs", None)
    if optimistic is None:
        return no_early_bound
    class Optimistic:  # the table's optimistic costs in the place of its costs
        def chain_costs(self, *, micro_batch_size: int, tp: int, dtype: str) -> ChainCosts:
            return optimistic(micro_batch_size=micro_batch_size, tp=tp, dtype=dtype)

        def state_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32",
                        layered: bool = False) -> int:
            return table.state_bytes(parameter_bytes, dp=dp, zero=zero, dtype=dtype, layered=layered)

    def early(layout) -> float:
        if layout.schedule != "zb-h1":
            return lower_bound(Optimistic(), layout, cluster, hides_all=True) * (1 - 1e-9)  # under the exact bound's rounding
        costs = optimistic(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
        plain = lower_bound(Optimistic(), dataclasses.replace(layout, schedule="1f1b"), cluster, hides_all=True)
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
