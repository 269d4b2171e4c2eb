"""The whole plan by search: mesh shape, microbatches, schedule, recompute, ZeRO level and dtype.

    layouts(space) -> score each (cuts by bisection, refined by a closed-form step) -> simulate the finalists

Every way to run the model on ``world_size`` devices is a ``Layout``: ``pp * tp * dp =
world_size`` (TP inside a node unless pinned across), the micro-batch size (a divisor of each
replica's share of the global batch), the schedule (gpipe, 1f1b, interleaved with 2, 3, 4 or
6 chunks per rank, zb-h1, zbv), the ZeRO level (0 to 3; FSDP's never with a split backward:
``autopart.solve.data_parallel_tail``) and the dtype; sequence parallelism is the cost table's
(on with TP unless pinned off: it holds less and moves what TP alone moves). For each, the
cutter (``autopart.solve.bottleneck``) makes the slowest stage as fast as it can be; the step is
estimated in closed form (pipeline latency, the data-parallel collectives, the optimizer step),
and ``autopart.solve.refine`` moves the cuts while that estimate falls, each rank taking the
recompute modes that make it fastest within its memory. Layouts are visited in the order of a
lower bound on their estimate (asked only once a floor that needs no sharding lets it matter:
``autopart.solve.layout_bounds``) until it passes the ``finalists``-th best estimate. The
finalists are simulated action by action (``score``: the compiler's own prediction) and ranked.
A large search cuts its layouts ahead of their turn in worker processes
(``autopart.solve.scoring_pool``), with the same result as one process.

Costs come from a ``CostTable``: per (micro-batch size, tp, dtype) the chain's ``ChainCosts``.
Nothing here names a device."""

from __future__ import annotations

import dataclasses
import functools
import collections
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from autopart.ir.divisors import divisors
from autopart.ir.errors import ConfigError
from autopart.schedule import MOST_MICROBATCHES, SCHEDULE_KINDS, stage_placement
from autopart.solve.closed_form import estimate_step_s
from autopart.solve.data_parallel_tail import fsdp_may_pay, fully_sharded_levels, last_bucket_bytes
from autopart.solve.vshape import zbv_fits
from autopart.predict.in_flight import in_flight, rank_in_flight, transient as transient_count
from autopart.ir.recompute import RECOMPUTE_MODES
from autopart.solve.bottleneck import StageCut, cut_stages, fixed_cut
from autopart.solve.chain_costs import ChainCosts
from autopart.solve.layout_bounds import (cut_within_owners, early_bound, layout_bound, lazy_order, may_fit,
                                         mesh_overhead_bytes, with_layout_state, with_owners)
from autopart.solve.replica_shares import owners_beyond_shares, parameter_bytes_per_rank, slowest_replica_bytes
from autopart.solve.refine import CutJudge, refine_cuts
from autopart.solve.scoring_pool import LayoutScoring, search_workers
from autopart.solve.transfers import boundary_transfer_s
from cost_models.comm import NodeSpan, node_span

__all__ = ["Layout", "SearchSpace", "Cluster", "CostTable", "Scored", "SearchResult", "Speculation", "search", "fits",
           "score_layout"]

_AT_TURN = object()  # in the walk's queue: a layout sent at its turn, not ahead (where it was mostly work wasted)
INTERLEAVED_CHUNKS = (2, 3, 4, 6)  # per rank; more (8, 12) slow the search ninefold: pin --chunks
MAX_MICRO_BATCH_SIZE = 16
"""Micro-batch sizes searched by default: the divisors of a replica's batch up to this."""


@dataclass(frozen=True, kw_only=True, order=True)
class Layout:
    """One way to run the model; the cuts and the recompute per stage come with its score."""

    pp: int
    tp: int
    dp: int
    micro_batch_size: int
    microbatches: int
    schedule: str
    chunks: int = 1
    zero: int = 0  # ZeRO level (``autopart.predict.memory``); True reads as 1
    dtype: str = "fp32"

    @property
    def stages(self) -> int:
        return self.pp * self.chunks

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    def data_parallel_span(self, gpus_per_node: int) -> NodeSpan:
        """How a data-parallel group lies on the nodes: data parallelism is outermost, a replica's ranks apart."""
        return node_span(self.dp, self.pp * self.tp, gpus_per_node, self.world_size)

    def pipeline_crosses_nodes(self, gpus_per_node: int) -> bool:
        """A pipeline (pp x tp ranks, tensor parallelism innermost) spans nodes once it has more ranks than a node."""
        return self.pp * self.tp > gpus_per_node

    def describe(self) -> str:
        schedule = f"{self.schedule} v={self.chunks}" if self.chunks > 1 else self.schedule
        level = {0: "", 1: " zero"}.get(int(self.zero), f" zero{int(self.zero)}")
        extras = "".join([level, f" {self.dtype}" if self.dtype != "fp32" else ""])
        return f"pp{self.pp} tp{self.tp} dp{self.dp} {self.microbatches}x{self.micro_batch_size} {schedule}{extras}"


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What the search may choose; a pinned option is a tuple of one value."""

    world_size: int
    global_batch_size: int
    gpus_per_node: int = 8
    pp: tuple[int, ...] | None = None
    tp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    micro_batch_size: tuple[int, ...] | None = None
    microbatches: tuple[int, ...] | None = None
    schedule: tuple[str, ...] = SCHEDULE_KINDS
    chunks: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    dtype: tuple[str, ...] = ("fp32",)
    recompute: tuple[str, ...] = RECOMPUTE_MODES  # modes any stage may take
    recompute_per_stage: tuple[str, ...] | None = None  # a pin of one mode per stage
    tp_across_nodes: bool = False
    least_tp: int = 1  # 2 where the options ask for what only tensor parallelism does (--sp, --tp-overlap)

    def layouts(self, blocks: int) -> Iterator[Layout]:
        """Every layout of the space that a chain of ``blocks`` blocks can take."""
        n, batch = self.world_size, self.global_batch_size
        for tp in self.tp or divisors(n):
            if tp > self.gpus_per_node and not (self.tp_across_nodes or self.tp) or tp < self.least_tp:
                continue
            for pp in self.pp or divisors(n // tp):
                if n % (tp * pp) or pp > blocks:
                    continue
                dp = n // (tp * pp)
                if self.dp and dp not in self.dp:
                    continue
                if self.recompute_per_stage and len(self.recompute_per_stage) % pp:
                    continue
                if batch % dp:
                    continue
                share = batch // dp
                for mbs in self._micro_batch_sizes(share):
                    m = share // mbs
                    for schedule, chunks in self._schedules(pp, m, blocks):
                        # without data parallelism nothing shards: a pinned ZeRO level rules the layout out
                        levels = fully_sharded_levels(self.zero, schedule) if dp > 1 else (0,) if 0 in self.zero else ()
                        for zero in levels:
                            for dtype in self.dtype:
                                yield Layout(pp=pp, tp=tp, dp=dp, micro_batch_size=mbs, microbatches=m,
                                             schedule=schedule, chunks=chunks, zero=zero, dtype=dtype)

    def smallest_micro_batch_size(self) -> int:
        """The smallest micro-batch size of any layout (1 when there is none): the leanest, and
        a size to capture the chain at when any will do (its blocks do not depend on it)."""
        return min((layout.micro_batch_size for layout in self.layouts(1 << 30)), default=1)

    def _micro_batch_sizes(self, share: int) -> list[int]:
        """The micro-batch sizes a replica's ``share`` of the batch may take, each in at most
        `MOST_MICROBATCHES`: up to `MAX_MICRO_BATCH_SIZE`, or the least that the count allows."""
        if self.microbatches:
            sizes = [share // m for m in self.microbatches if share % m == 0]
        elif self.micro_batch_size:
            sizes = [b for b in self.micro_batch_size if share % b == 0]
        else:
            sizes = divisors(share)
        sizes = [b for b in sizes if share // b <= MOST_MICROBATCHES]
        if self.microbatches or self.micro_batch_size:
            return sizes
        return [b for b in sizes if b <= MAX_MICRO_BATCH_SIZE] or sizes[:1]

    def _schedules(self, pp: int, m: int, blocks: int) -> list[tuple[str, int]]:
        found = []
        for kind in self.schedule:
            if kind == "interleaved":
                for v in self.chunks or INTERLEAVED_CHUNKS:
                    if m % pp == 0 and pp * v <= blocks and v > 1:
                        found.append((kind, v))
            elif kind == "zbv":
                if zbv_fits(pp, m, blocks, self.chunks):
                    found.append((kind, 2))
            elif not self.chunks or self.chunks == (1,):
                found.append((kind, 1))
        if pp == 1:  # one rank runs every forward then every backward: one schedule stands for all, with its chunks
            return [("1f1b", 1)] if ("1f1b", 1) in found else found[:1]
        return found


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The devices and how long things take on them (through the cost model's callbacks)."""

    memory_bytes: int
    overhead_bytes: int  # per rank, before the model
    gpus_per_node: int
    p2p_s: Callable[[float, bool], float]  # (bytes, across nodes) -> seconds
    all_reduce_s: Callable[[float, int, NodeSpan], float]  # (bytes, group, how it lies on the nodes) -> seconds
    all_gather_s: Callable[[float, int, NodeSpan], float]
    optimizer_s_per_byte: float  # seconds of the optimizer step per byte of parameters
    reduction_overlaps: bool = False
    """The data-parallel collectives run beside the compute (a GPU's streams): the all-reduce
    hides behind the backward (``autopart.predict.reduction``), a reduce-scatter behind the next
    forward (``autopart.predict.data_parallel``). False: they add to the step."""
    overlap_slowdown: float = 0.0
    """How much longer the compute takes while they run beside it (the device's
    ``overlap_compute_slowdown``; `autopart.predict.fully_sharded.slowing`)."""
    communicator_bytes: Callable[[int, int, int, str], int] = lambda pp, tp, dp, schedule: 0  # -> per rank, besides
    # overhead_bytes: the collective library's buffers (`cost_models.memory.communicator_bytes`)


class CostTable(Protocol):
    def chain_costs(self, *, micro_batch_size: int, tp: int, dtype: str) -> ChainCosts:
        """The chain's costs per microbatch on one rank of a tensor-parallel group of ``tp``."""

    def state_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32", layered: bool = False,
                    frozen: bool = False) -> int:
        """Weights, gradients and optimizer state of a share of ``parameter_bytes`` (of a repeated
        ``layered``; of a ``frozen`` one, weights alone: `autopart.predict.memory.state_bytes`)."""

    def owned_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32",
                    frozen: bool = False) -> int:
        """Of those, what ZeRO-1 leaves whole to the replica that owns the tensor (`autopart.predict.memory.owned_bytes`)."""


@dataclass(frozen=True, kw_only=True)
class Scored:
    layout: Layout
    cut: StageCut
    estimate_s: float  # closed form, used to rank all layouts
    step_s: float = math.nan  # simulated (finalists only)

    @property
    def recompute(self) -> tuple[str, ...]:
        return self.cut.recompute

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.cut.rank_memory_bytes)


@dataclass(frozen=True, kw_only=True)
class Speculation:
    """A layout scored under a last finalist ``refine_below`` that may be lower at its turn in the
    search (``autopart.solve.scoring_pool``): its answer under that one and under any lower."""

    plain: Scored | None  # the bisection's cuts, as they are
    refine_from: float  # the cuts are refined under a last finalist above this (-inf: under any)
    refined: Scored | None = None  # where they were

    def under(self, refine_below: float) -> Scored | None:
        return self.refined if refine_below > self.refine_from else self.plain


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    ranked: tuple[Scored, ...]  # finalists, best first, by simulated step
    layouts: int  # layouts in the space
    scored: int  # layouts cut and estimated
    fitting: int  # of those, the ones that fit in memory
    seconds: float
    bound_s: float  # no layout's estimate is below this

    @property
    def best(self) -> Scored:
        return self.ranked[0]


def search(
    space: SearchSpace,
    table: CostTable,
    cluster: Cluster,
    *,
    finalists: int = 5,
    score: Callable[[Scored], float] | None = None,
    progress: Callable[[int, int], None] | None = None,
    workers: int | None = None,
    score_on_workers: bool = False,
    meanwhile: Callable[[list[Scored]], None] | None = None,
) -> SearchResult:
    """The ``finalists`` best layouts that fit, ranked by ``score`` (default: the estimate).
    ``workers``: processes that score layouts ahead (``autopart.solve.scoring_pool``; by default
    `search_workers`); the result is the same on any number. ``score_on_workers``: ``score`` may
    run there too, as it reads nothing but the table's costs of the finalist and changes nothing.
    ``meanwhile(finalists)``: work of the caller's, run here while ``score`` scores them."""
    start = time.perf_counter()
    blocks = len(table.chain_costs(micro_batch_size=space.smallest_micro_batch_size(), tp=1, dtype=space.dtype[0]))
    layouts = list(space.layouts(blocks))
    if not layouts:
        raise ConfigError(_no_layout_message(space))
    cluster = _memoised(cluster)
    best: list[Scored] = []  # the finalists so far, by estimate

    def cutoff() -> float | None:
        return best[-1].estimate_s if len(best) >= finalists else None

    def last_finalist_s() -> float:
        return best[-1].estimate_s if len(best) >= finalists else math.inf

    built: set[tuple] = set()  # the keys whose costs this process holds: a worker forked after them has them

    def exact(layout: Layout) -> float:
        built.add(_chain_key(layout))  # by the bound, which costs the chain before the layout is sent
        return layout_bound(table, layout, cluster)

    bounded = iter(lazy_order(layouts, exact=exact, early=early_bound(table, cluster), cutoff=cutoff))
    scored = fitting = 0
    settled: set[Layout] = set()  # ZeRO-1 layouts whose ZeRO-2 twins cannot do better
    smallest_bound = math.inf
    sent: collections.deque = collections.deque()  # (bound, layout, handle): in turn, scored ahead or at it
    scoring = LayoutScoring(lambda layout, below: _speculate(layout, table, cluster, space, below),
                            workers=search_workers(len(layouts)) if workers is None else workers,
                            key=_chain_key, built=built, finish=score, finish_on_workers=score_on_workers)
    with scoring:
        for visited in itertools.count():
            while len(sent) < scoring.ahead and (item := next(bounded, None)) is not None:
                bound, layout = item
                sent.append((bound, layout, _sent(layout, scoring, settled, sent, last_finalist_s())))
            if not sent or (cutoff() is not None and sent[0][0] >= cutoff()):
                break  # where one process's walk ends: the bound at its turn reaches the last finalist
            bound, layout, handle = sent.popleft()
            smallest_bound = min(smallest_bound, bound)
            if progress is not None:
                progress(visited, len(layouts))
            if _settled_twin(layout, settled):
                continue
            if handle is _AT_TURN:
                handle = scoring.here(layout, last_finalist_s())
            scored += 1
            result = handle.result().under(last_finalist_s())
            if result is None or (layout.zero == 1 and not fsdp_may_pay(result, table, cluster)):
                settled.add(layout)
            if result is None:
                continue
            fitting += 1
            best.append(result)
            best.sort(key=lambda s: (s.estimate_s, s.layout))
            del best[finalists:]
        scoring.drop_ahead()  # sent ahead of a turn that never came
        steps = [s.estimate_s for s in best] if score is None else scoring.finished(best, meanwhile)
    if progress is not None:
        progress(len(layouts), len(layouts))
    ranked = sorted((dataclasses.replace(s, step_s=step) for s, step in zip(best, steps)),
                    key=lambda s: (s.step_s, s.layout))
    return SearchResult(ranked=tuple(ranked), layouts=len(layouts), scored=scored, fitting=fitting,
                        seconds=time.perf_counter() - start, bound_s=smallest_bound if best else math.inf)


def _sent(layout: Layout, scoring: LayoutScoring, settled: set[Layout], queued, below: float):
    """``layout``'s future, scored ahead under the last finalist ``below``; None where its twin
    settled it; `_AT_TURN` while its ZeRO-1 twin is ``queued`` (its turn to come): that may settle it."""
    if _settled_twin(layout, settled):
        return None
    if layout.zero == 2 and dataclasses.replace(layout, zero=1) in (queued_layout for _, queued_layout, _ in queued):
        return _AT_TURN
    return scoring.submit(layout, below)


def _chain_key(layout: Layout) -> tuple:
    """The chain costs a layout's scoring reads, as the table keeps them."""
    return layout.micro_batch_size, layout.tp, layout.dtype


def _settled_twin(layout: Layout, settled: set[Layout]) -> bool:
    """A ZeRO-2 layout whose ZeRO-1 twin does not fit, or hides its all-reduce (``fsdp_may_pay``):
    it cannot do better than its twin (ZeRO-3 may fit, and is not skipped)."""
    return layout.zero == 2 and dataclasses.replace(layout, zero=1) in settled


def _memoised(cluster: Cluster) -> Cluster:
    """The same cluster, each time it has computed remembered: the search asks the same ones often."""
    return dataclasses.replace(
        cluster,
        p2p_s=functools.lru_cache(maxsize=None)(cluster.p2p_s),
        all_reduce_s=functools.lru_cache(maxsize=None)(cluster.all_reduce_s),
        all_gather_s=functools.lru_cache(maxsize=None)(cluster.all_gather_s),
    )


def fits(space: SearchSpace, table: CostTable, cluster: Cluster) -> bool:
    """Whether any layout of ``space`` fits in the cluster's memory (its speed aside): the
    cutter's quick answer first, then, where it finds no cuts, the refinement the search itself
    runs (which finds cuts the greedy cutter misses when interleaved stages share a rank). A
    layout that ``may_fit`` refuses has no cuts that fit, and is not cut."""
    blocks = len(table.chain_costs(micro_batch_size=space.smallest_micro_batch_size(), tp=1, dtype=space.dtype[0]))
    return any(may_fit(table, layout, cluster)
               and (score_layout(layout, table, cluster, space, fit_only=True) is not None
                    or score_layout(layout, table, cluster, space) is not None)
               for layout in space.layouts(blocks))


def score_layout(layout: Layout, table: CostTable, cluster: Cluster, space: SearchSpace,
                 recompute: tuple[tuple[str, ...], ...] | None = None,
                 cuts: tuple[int, ...] | None = None, fit_only: bool = False,
                 refine_below: float = math.inf) -> Scored | None:
    """Cut ``layout`` (or take its ``cuts``) and estimate its step; None when it cannot fit.
    ``fit_only``: any cuts that fit, not the fastest. Otherwise the cuts are refined by the step
    itself (``autopart.solve.refine``) unless the layout's slowest stage alone keeps its step at
    or above ``refine_below`` (the search's last finalist)."""
    found = _cut_and_estimate(layout, table, cluster, space, recompute, cuts, fit_only, refine_below)
    return found.under(refine_below) if isinstance(found, Speculation) else found


def _speculate(layout: Layout, table: CostTable, cluster: Cluster, space: SearchSpace, refine_below: float) -> Speculation:
    """`score_layout`'s answer (cut and refined) under ``refine_below`` and every smaller last finalist."""
    return _cut_and_estimate(layout, table, cluster, space, None, None, False, refine_below)


def _cut_and_estimate(layout: Layout, table: CostTable, cluster: Cluster, space: SearchSpace,
                      recompute: tuple[tuple[str, ...], ...] | None, cuts: tuple[int, ...] | None, fit_only: bool,
                      refine_below: float) -> Scored | Speculation | None:
    """`score_layout`: a `Speculation` where it cuts and may refine, else the answer itself."""
    costs = with_layout_state(table, layout)
    stages = layout.stages
    cluster = dataclasses.replace(cluster, overhead_bytes=mesh_overhead_bytes(layout, costs, cluster))  # this mesh's
    ranks = stage_placement(layout.schedule, ranks=layout.pp, chunks=layout.chunks)
    transfer = boundary_transfer_s(costs, layout, cluster)
    flight = in_flight(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
    moments = rank_in_flight(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
    transient = transient_count(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
    if recompute is not None:
        modes = recompute
    elif space.recompute_per_stage:
        modes = tuple((mode,) for mode in space.recompute_per_stage)
    else:
        modes = (space.recompute,) * stages
    if len(modes) != stages:
        return None if cuts is not None or fit_only else Speculation(plain=None, refine_from=math.inf)
    dp_span = layout.data_parallel_span(cluster.gpus_per_node)
    owners = owners_beyond_shares(table, layout, costs)  # one per layout: what it gives each rank's spans is kept
    stepped = slowest_replica_bytes(layout, costs)
    if cuts is not None:
        cut = fixed_cut(costs, cuts, modes=modes, in_flight=flight, transient=transient, stage_rank=ranks,
                        transfer_s=transfer, memory_limit_bytes=cluster.memory_bytes,
                        overhead_bytes=cluster.overhead_bytes, rank_in_flight=moments)
    else:
        def cutter(memory_bytes: int) -> StageCut | None:
            return cut_stages(costs, stages=stages, in_flight=flight, stage_rank=ranks, transfer_s=transfer,
                              memory_limit_bytes=memory_bytes, overhead_bytes=cluster.overhead_bytes, modes=modes,
                              transient=transient, fit_only=fit_only, rank_in_flight=moments)

        cut = cut_within_owners(cutter, owners, blocks=len(costs), ranks=ranks, memory_limit_bytes=cluster.memory_bytes)
        if not fit_only:
            return _with_refinement(layout, table, cluster, costs, cut, modes, flight, transient, ranks, transfer, dp_span,
                                    refine_below, owners, stepped)
    cut = with_owners(cut, owners, blocks=len(costs), ranks=ranks, memory_limit_bytes=cluster.memory_bytes)
    if cut is None:
        return None
    rank_bytes = parameter_bytes_per_rank(table, layout, cut, ranks)
    estimate = estimate_step_s(layout, cut, cluster, rank_bytes, dp_span, last_bucket_bytes(layout, costs, cut.cuts),
                               costs, stepped)
    return Scored(layout=layout, cut=cut, estimate_s=estimate)


def _with_refinement(layout, table, cluster, costs, cut, modes, flight, transient, ranks, transfer, dp_span,
                     refine_below, owners, stepped) -> Speculation:
    """The bisection's cut, and refined by the step itself where that may bring it into the finalists."""
    judge = CutJudge(costs, in_flight=flight, transient=transient, stage_rank=ranks, transfer_s=transfer,
                     rank_in_flight=rank_in_flight(layout.schedule, layout.pp, layout.microbatches, layout.chunks),
                     memory_limit_bytes=cluster.memory_bytes, overhead_bytes=cluster.overhead_bytes, modes=modes,
                     objective=lambda c, rank_bytes: estimate_step_s(layout, c, cluster, rank_bytes, dp_span,
                                                                     last_bucket_bytes(layout, costs, c.cuts), costs,
                                                                     stepped),
                     rank_extra=owners)
    judged = judge.judge(cut.cuts) if cut is not None else None  # None too where ZeRO-1's owners break the limit
    if judged is None:
        refine_from = -math.inf  # refined whatever the finalists: it may find cuts that fit
    elif layout.chunks == 1:  # under it, no cuts of this layout make the finalists: its slowest stage keeps it out
        refine_from = _refine_bound(table, layout, cluster, cut)
    else:  # interleaved and out of the finalists as cut: not refined (no bound says it could not get in)
        refine_from = judged[0]
    plain = None if judged is None else Scored(layout=layout, cut=judged[1], estimate_s=judged[0])
    if refine_below <= refine_from:
        return Speculation(plain=plain, refine_from=refine_from)
    refined = refine_cuts(judge, cut)
    return Speculation(plain=plain, refine_from=refine_from,
                       refined=None if refined is None else Scored(layout=layout, cut=refined[1], estimate_s=refined[0]))


def _refine_bound(table: CostTable, layout: Layout, cluster: Cluster, cut: StageCut) -> float:
    """``layout_bound`` with the bisection's smallest slowest stage for a floor, where it is more
    (the cut in hand fits; ``cluster`` may carry the mesh's overhead already)."""
    return layout_bound(table, layout, cluster, slowest_s=cut.bound_s, memory=False)


def _no_layout_message(space: SearchSpace) -> str:
    pinned = {name: values[0] for name in ("pp", "tp", "dp") if (values := getattr(space, name)) and len(values) == 1}
    product = math.prod(pinned.values())
    if space.world_size % product or (len(pinned) == 3 and product != space.world_size):  # the pins alone, named
        pins = " x ".join(f"--{name} {value}" for name, value in pinned.items())
        said = pins if len(pinned) == 1 else f"{pins} = {product}"
        return (f"{said} {'is not' if len(pinned) == 3 else 'does not divide'} --world-size {space.world_size}: "
                "pp x tp x dp must equal the world size; change a pin or --world-size")
    return (
        f"no layout of {space.world_size} devices fits the pins and a global batch of {space.global_batch_size}: "
        "pp x tp x dp must equal --world-size, dp must divide the global batch (and be 2 or more with --zero), "
        "interleaved needs microbatches divisible by pp"
        f"{', --sp and --tp-overlap need tp 2 or more within a node' if space.least_tp > 1 else ''}"
        f", and a replica runs at most {MOST_MICROBATCHES} microbatches; relax a pin or change --global-batch-size"
    )

