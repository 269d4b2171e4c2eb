"""Whole-plan baselines: the layouts a person or a published planner would try, scored exactly as
autopart scores its own (``autopart.solve.search.score_layout``, the closed-form step estimate).

- ``grid_search``: Megatron-LM's recipe (Narayanan et al., SC21, §5): every valid (t, p, d)
  with tensor parallelism inside a node, every micro-batch size, the 1F1B schedule, with or
  without the distributed optimizer (``--use-distributed-optimizer``: ZeRO-1) or Megatron-FSDP
  (``--use-megatron-fsdp`` with ``--data-parallel-sharding-strategy optim_grads``: ZeRO-2, or
  ``optim_grads_params``: ZeRO-3; Megatron-Core's guards do not keep it from pipelines), sequence
  parallelism as the cost table has it (``--sequence-parallel``; the compiler's tables have it on
  with TP, as its search does), one recompute setting for the whole model (none, selective or
  full), and a partitioner for the
  cuts: ``equal_layer_cuts`` for Megatron itself; the other partitioners of
  ``autopart.solve.baselines`` on the same grid give "the best layout with that partitioner".
- ``exhaustive_search``: every layout of the search space, every cut set, every recompute mode
  per stage; for small chains only (it says how many candidates it would score before it starts).

Each keeps its ``top`` few candidates by estimate, so that a benchmark can rank them again by
simulation (``autopart.solve.simulated``), as the search ranks its finalists.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from autopart.ir.errors import ConfigError
from autopart.solve.search import Cluster, CostTable, Scored, SearchSpace, score_layout
from autopart.solve.baselines import (
    Layers,
    equal_layer_cuts,
    parameter_balanced_cuts,
    pipedream_cuts,
    uniform_cuts,
)
from autopart.solve.chain_costs import ChainCosts
from autopart.solve.transfers import boundary_transfer_s

__all__ = [
    "BaselineResult",
    "Partitioner",
    "PARTITIONERS",
    "grid_space",
    "grid_search",
    "exhaustive_count",
    "exhaustive_search",
]

Partitioner = Callable[[ChainCosts, Layers, int, str, tuple[float, ...]], tuple[int, ...]]
"""(costs, layer per block, stages, recompute mode, one-way transfer seconds per boundary) -> cuts;
raises ``ConfigError`` when it cannot cut this chain into that many stages."""

PARTITIONERS: dict[str, Partitioner] = {
    "uniform": lambda costs, layers, stages, mode, transfer: uniform_cuts(layers, stages),
    "parameters": lambda costs, layers, stages, mode, transfer: parameter_balanced_cuts(costs, layers, stages),
    "pipedream": lambda costs, layers, stages, mode, transfer: pipedream_cuts(costs, stages, transfer_s=transfer,
                                                                             recompute=mode),
    "megatron": lambda costs, layers, stages, mode, transfer: equal_layer_cuts(layers, stages),
}
"""DeepSpeed's uniform and parameters, PipeDream's dynamic program, Megatron's equal layers."""

LayersOf = Callable[[int, int, str], Layers]
"""(micro-batch size, tp, dtype) -> the layer per block of that table's chain."""


@dataclass(frozen=True, kw_only=True)
class BaselineResult:
    name: str
    best: Scored | None  # None: no candidate fits (or, exhaustive, too many to try)
    candidates: int  # (layout, cuts, recompute) triples scored
    seconds: float
    finished: bool = True
    top: tuple[Scored, ...] = ()  # the best few candidates by estimate, best first (``best`` is top[0])

    @property
    def step_s(self) -> float:
        return self.best.estimate_s if self.best is not None else math.inf


def grid_space(space: SearchSpace) -> SearchSpace:
    """Megatron's grid inside ``space``: 1F1B, no interleaving, every ZeRO level of ``space``
    (Megatron's distributed optimizer is ZeRO-1, Megatron-FSDP's sharding strategies ZeRO-2
    and 3: a baseline gets every option its system has), the same pins otherwise."""
    return dataclasses.replace(space, schedule=("1f1b",), chunks=None)


def grid_search(name: str, space: SearchSpace, table: CostTable, cluster: Cluster, partition: Partitioner,
                layers_of: LayersOf, *, top: int = 5) -> BaselineResult:
    """The best layout of Megatron's grid with ``partition``'s cuts and one recompute setting (and
    the ``top`` best)."""
    start = time.perf_counter()
    grid = grid_space(space)
    blocks = len(table.chain_costs(micro_batch_size=_first(grid).micro_batch_size, tp=1, dtype=grid.dtype[0]))
    best: list[Scored] = []
    candidates = 0
    for layout in grid.layouts(blocks):
        costs = table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
        transfer = boundary_transfer_s(costs, layout, cluster)
        layers = layers_of(layout.micro_batch_size, layout.tp, layout.dtype)
        for mode in space.recompute:
            try:
                cuts = partition(costs, layers, layout.pp, mode, transfer) if layout.pp > 1 else ()
            except ConfigError:  # fewer layers than stages
                continue
            candidates += 1
            scored = score_layout(layout, table, cluster, grid, recompute=((mode,),) * layout.stages, cuts=cuts)
            _keep(best, scored, top)
    return BaselineResult(name=name, best=best[0] if best else None, candidates=candidates,
                          seconds=time.perf_counter() - start, top=tuple(best))


def _keep(best: list[Scored], scored: Scored | None, top: int) -> None:
    """Add ``scored`` to ``best`` (sorted by estimate, then layout) if it is among the ``top``."""
    if scored is None:
        return
    key = (scored.estimate_s, scored.layout)
    if len(best) >= top and key >= (best[-1].estimate_s, best[-1].layout):
        return
    best.append(scored)
    best.sort(key=lambda s: (s.estimate_s, s.layout))
    del best[top:]


def _first(space: SearchSpace):
    for layout in space.layouts(1 << 30):
        return layout
    raise ValueError("the grid has no layout")


def exhaustive_count(space: SearchSpace, blocks: int) -> int:
    """(layout, cuts, per-stage recompute) triples that ``exhaustive_search`` would score."""
    modes = len(space.recompute)
    return sum(math.comb(blocks - 1, layout.stages - 1) * modes**layout.stages for layout in space.layouts(blocks))


def exhaustive_search(space: SearchSpace, table: CostTable, cluster: Cluster, *, limit: int = 200_000,
                      top: int = 5) -> BaselineResult:
    """The best of every layout x every cut set x every recompute mode per stage; not started
    (``finished=False``) when that is more than ``limit`` candidates."""
    start = time.perf_counter()
    blocks = len(table.chain_costs(micro_batch_size=_first(space).micro_batch_size, tp=1, dtype=space.dtype[0]))
    if exhaustive_count(space, blocks) > limit:
        return BaselineResult(name="exhaustive", best=None, candidates=0, seconds=0.0, finished=False)
    best: list[Scored] = []
    candidates = 0
    for layout in space.layouts(blocks):
        for cuts in itertools.combinations(range(blocks - 1), layout.stages - 1):
            for modes in itertools.product(space.recompute, repeat=layout.stages):
                candidates += 1
                scored = score_layout(layout, table, cluster, space, recompute=tuple((m,) for m in modes), cuts=cuts)
                _keep(best, scored, top)
    return BaselineResult(name="exhaustive", best=best[0] if best else None, candidates=candidates,
                          seconds=time.perf_counter() - start, top=tuple(best))
