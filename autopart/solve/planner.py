"""The compiler's side of the search: costs from real captures, finalists predicted like any plan.

``plan_by_search(options)`` is what ``autopart compile --world-size N`` runs:

1. ``FrontTable`` (``autopart.solve.front_table``) gives ``autopart.solve.search`` the chain's
   costs for each micro-batch size, dtype and tensor-parallel degree it asks about, capturing and
   annotating the model once per micro-batch size (the graph's shapes depend on it) and sharding
   per degree.
2. ``autopart.solve.search.search`` scores the layouts and keeps the finalists.
3. Each finalist becomes a Plan through the compiler's own ``plan_from_cuts``, so its
   predicted step is the one that a pinned plan with the same choices gets; they are ranked by it.
4. The best one's cuts are given to CP-SAT as a start when the chain is small enough to prove
   them optimal (CP-SAT improves them if it can), and its bound and gap go into the plan.
5. When nothing fits, one line says the memory per device, or the world size, that would.

A model with a long run of identical layers (``autopart.passes.shallow``) is searched through a copy
that keeps two of them: ``shallow_table`` captures that copy at each micro-batch size and lays
its chain out to full depth (``autopart.solve.repeat``), so that a capture costs two layers, not
eighty. Its finalists are ranked by the schedule simulator on those costs
(``autopart.solve.simulated``), and the full model is captured once, for the first of them
that fits as a plan; that plan (step 3's, exactly) is the one emitted.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Set
from dataclasses import dataclass, replace

from torch import nn

from autopart.ir.errors import ConfigError, InfeasibleError, PrecisionError, gib_up
from autopart.ir.plan import Plan
from autopart.ir.recompute import RECOMPUTE_MODES
from autopart.ir.tensors import SEARCHED_DTYPES
from autopart.options import CompileOptions, local_kind
from autopart.passes.front import Front
from autopart.passes.repeat_annotation import LAID_OUT_FROM
from autopart.passes.shallow import KEPT_LAYERS, repeated_layers, shallow_module
from autopart.runtime.fully_sharded import FSDP_LEVELS, check_shardable, runs_here, scalar_parameter
from autopart.schedule import SCHEDULE_KINDS, validation_beside
from autopart.solve.assemble import pipeline_problem, plan_from_cuts, with_solver
from autopart.solve.baselines import block_layers
from autopart.solve.front_table import FrontTable, Progress, sequence_parallel
from autopart.solve.layout_bounds import may_fit
from autopart.solve.pipeline import evaluate, solve_cuts
from autopart.solve.repeat import NotLaidOut, RepeatedTable, repeat_last
from autopart.solve.scoring_pool import search_workers
from autopart.solve.search import Cluster, Layout, Scored, SearchResult, SearchSpace, fits, score_layout, search
from autopart.solve.simulated import simulated_step_s
from cost_models import get_cost_model
from cost_models.memory import communicator_bytes

log = logging.getLogger("autopart")

__all__ = ["FrontTable", "capture_ahead", "plan_by_search", "search_space", "cluster_of", "shallow_table",
           "sequence_parallel"]

CP_SAT_LIMIT = 2_000
"""CP-SAT refines the chosen cuts when blocks x stages is at most this (its model's size)."""


def search_space(options: CompileOptions) -> SearchSpace:
    """The options as a search space: each option given is a pin."""
    if options.global_batch_size is None:
        raise ConfigError("the search needs the global batch: add --global-batch-size B (samples per step)")
    if options.microbatches is not None and options.micro_batch_size is not None:
        raise ConfigError("give --microbatches or --micro-batch-size, not both: the global batch fixes the other")

    def pin(value):
        return None if value is None else (value,)

    return SearchSpace(
        world_size=options.world_size,
        global_batch_size=options.global_batch_size,
        gpus_per_node=options.gpus_per_node,
        pp=pin(options.pp),
        tp=pin(options.tp),
        dp=pin(options.dp),
        micro_batch_size=pin(options.micro_batch_size),
        microbatches=pin(options.microbatches),
        schedule=pin(options.schedule) or SCHEDULE_KINDS,
        chunks=pin(options.chunks),
        zero=pin(options.zero) or tuple(level for level in (0, 1, 2, 3) if runs_here(level)),
        dtype=SEARCHED_DTYPES if options.dtype == "auto" else (options.dtype or "fp32",),
        recompute=(options.recompute,) if isinstance(options.recompute, str) else RECOMPUTE_MODES,
        recompute_per_stage=options.recompute if isinstance(options.recompute, tuple) else None,
        # a search keeps sp None unless it was given (`CompileOptions` fills it in only where nothing is searched)
        least_tp=2 if options.tp_overlap or options.sp is True else 1,
    )


def cluster_of(options: CompileOptions) -> Cluster:
    cost_model = get_cost_model(options.device)
    device = cost_model.device
    memory = round(options.memory_gib * (1 << 30)) if options.memory_gib is not None else device.memory_bytes
    sample = 1 << 22  # elements: an optimizer step is bandwidth-bound, its time per byte settles by here
    per_byte = cost_model.optimizer_time(options.optimizer, [((sample,), "torch.float32")]) / (4 * sample)
    return Cluster(
        memory_bytes=memory,
        overhead_bytes=device.framework_overhead_bytes,
        gpus_per_node=options.gpus_per_node,
        p2p_s=lambda nbytes, across: cost_model.p2p_time(nbytes, across_nodes=across),
        all_reduce_s=lambda nbytes, group, span: cost_model.collective_time("all_reduce", nbytes, group, nodes=span.nodes,
                                                                            members=span.fewest),
        all_gather_s=lambda nbytes, group, span: cost_model.collective_time("all_gather", nbytes, group, nodes=span.nodes,
                                                                            members=span.fewest),
        optimizer_s_per_byte=per_byte,
        reduction_overlaps=device.collectives_overlap_compute,  # as ``autopart.predict.step_time`` overlaps them
        overlap_slowdown=device.slowdown_beside_collectives,
        communicator_bytes=lambda pp, tp, dp, schedule: communicator_bytes(device.kind, pp=pp, tp=tp, dp=dp,
                                                                           schedule=schedule),
    )


@dataclass(frozen=True, kw_only=True)
class Finalist:
    """A finalist planned on the full model, and fitting: its row of the plan's
    ``provenance.search["ranked"]``, its plan, and the front its programs are emitted from."""

    row: int
    plan: Plan
    front: Front


@dataclass(frozen=True, kw_only=True)
class Searched:
    plan: Plan
    front: Front
    result: SearchResult
    finalists: tuple[Finalist, ...]  # the chosen one first (row 0), then the others planned, as their rows go


def shallow_table(full: FrontTable) -> RepeatedTable | None:
    """The search's costs from a copy of the model with two of its repeated layers
    (``autopart.passes.shallow``), laid out to full depth; None when the model has no long run of
    layers alike."""
    spec = full.model_spec()
    layers = repeated_layers(spec.module)
    if layers is None:
        return None
    shallow = FrontTable(full.options, full.progress, spec=replace(spec, module=shallow_module(spec.module, layers)),
                         largest_size=full.largest_size)
    laid_out_from = replace(spec, module=shallow_module(spec.module, layers, LAID_OUT_FROM))
    full.lay_out_from(FrontTable(full.options, full.progress, spec=laid_out_from), layers.path)

    def layers_of(micro_batch_size: int, tp: int, dtype: str) -> list[str | None]:
        # the list cut short alone: another list's layers (four attention blocks before ten MLP
        # blocks) are captured whole, and kept as the blocks before and after the list are
        chain = shallow.annotated_front(micro_batch_size=micro_batch_size, tp=tp, dtype=dtype).chain
        return [layer if layer is not None and layer.rsplit(".", 1)[0] == layers.path else None
                for layer in block_layers(chain)]

    return RepeatedTable(inner=shallow, layers_of=layers_of, pattern=repeat_last(KEPT_LAYERS, layers.count))


def plan_by_search(options: CompileOptions, *, progress: Progress | None = None, finalists: int = 5,
                   plan_every: bool = False) -> Searched:
    """The search's plan; ``plan_every``: every finalist is planned on the full model (they are
    to be run), where a shallow search plans only those whose estimate may beat the plans made."""
    space = search_space(options)
    search_workers(0)  # a $AUTOPART_SEARCH_WORKERS that is not a count is told before any capture
    sizes = {layout.micro_batch_size for layout in space.layouts(1 << 30)}  # those it asks costs at
    full = FrontTable(options, progress, largest_size=max(sizes, default=None))
    space = _shardable(space, full.model_spec().module)
    cluster = cluster_of(options)
    shallow = shallow_table(full)
    space = _runnable_dtypes(space, full if shallow is None else shallow.inner, min(sizes, default=1))
    if shallow is not None:
        searched = _shallow_search(options, space, cluster, full, shallow, progress=progress, finalists=finalists,
                                   plan_every=plan_every)
        if searched is not None:
            return searched
    return _full_search(options, space, cluster, full, progress=progress, finalists=finalists)


def _runnable_dtypes(space: SearchSpace, table, micro_batch_size: int) -> SearchSpace:
    """``space`` without the precisions the model does not run in (`PrecisionError`: an op that
    autocast gives two dtypes), where the search chooses among several; annotated here, before
    the search asks, so that it can leave them out (the costs are kept for it)."""
    if len(space.dtype) == 1:
        return space
    kept, refused = [], []
    for dtype in space.dtype:
        try:
            table.annotated_front(micro_batch_size=micro_batch_size, tp=1, dtype=dtype)
        except PrecisionError as error:
            log.info(f"the search leaves out {dtype}: {error}")
            refused.append(error)
        else:
            kept.append(dtype)
    if not kept:
        raise refused[0]
    return replace(space, dtype=tuple(kept))


def _shardable(space: SearchSpace, model: nn.Module) -> SearchSpace:
    """``space`` without FSDP's levels where the model holds a parameter they cannot shard
    (`autopart.runtime.fully_sharded.scalar_parameter`); refused where the user pinned one."""
    scalar = scalar_parameter(model)
    if scalar is None or not set(space.zero) & set(FSDP_LEVELS):
        return space
    kept = tuple(level for level in space.zero if level not in FSDP_LEVELS)
    if not kept:
        raise ConfigError(check_shardable(model, space.zero[0]))
    log.info(f"the search leaves out ZeRO 2 and 3: FSDP cannot shard the 0-dim parameter {scalar!r} (a tensor of one "
             "element can be)")
    return replace(space, zero=kept)


def _visited(progress: Progress | None) -> Callable[[int, int], None]:
    def visited(done: int, total: int) -> None:
        if progress is not None:
            progress("scoring layouts", done, total)

    return visited


def _full_search(options: CompileOptions, space: SearchSpace, cluster: Cluster, table: FrontTable, *,
                 progress: Progress | None, finalists: int) -> Searched:
    """Every finalist predicted exactly, as a plan of the full model."""
    plans: dict[Layout, Plan] = {}

    def exact(scored: Scored) -> float:
        plan = plans[scored.layout] = _plan_of(options, table, scored)
        # the cutter's memory is the compiler's up to what it simplifies (every batch input held
        # by a recomputing stage, each stage's own share of its rank): a finalist over the limit goes
        return plan.predicted.modelled_step_s if max(plan.predicted.memory_bytes) <= cluster.memory_bytes else math.inf

    result = search(space, table, cluster, finalists=finalists, score=exact, progress=_visited(progress))
    result = replace(result, ranked=tuple(s for s in result.ranked if s.step_s < math.inf))
    if not result.ranked:
        raise InfeasibleError(_does_not_fit(options, space, table, cluster))
    best = result.best
    plan, front = _refined(options, table, best, plans[best.layout], time_limit_s=options.time_limit_s)
    ordered = (plan, *(plans[s.layout] for s in result.ranked[1:]))
    rows = [(s, p.predicted.step_s, max(p.predicted.memory_bytes)) for s, p in zip(result.ranked, ordered)]
    plan = replace(plan, provenance=replace(plan.provenance, search=_summary(result, rows)))
    others = [Finalist(row=row, plan=ordered[row], front=_front_of(table, s))
              for row, s in enumerate(result.ranked) if row > 0]
    return Searched(plan=plan, front=front, result=result, finalists=(Finalist(row=0, plan=plan, front=front), *others))


def _shallow_search(options: CompileOptions, space: SearchSpace, cluster: Cluster, full: FrontTable,
                    shallow: RepeatedTable, *, progress: Progress | None, finalists: int,
                    plan_every: bool) -> Searched | None:
    """The search over the shallow copy's costs, its finalists ranked by the schedule simulator
    on those costs. The full model is planned for the first finalist, and for each next one
    whose estimate is below the fastest full plan that fits so far (the estimate and the full
    plan can differ by a few percent: a full plan's messages, its refined cuts); the fastest
    is kept. None when the full model's chain is not the shallow one's laid out (its layers are alike as
    modules but not as graphs, or called in turn with another list's): the caller then searches the
    full model."""
    try:
        result = search(space, shallow, cluster, finalists=finalists, progress=_visited(progress),
                        score=lambda scored: simulated_step_s(scored, shallow, cluster), score_on_workers=True,
                        meanwhile=lambda best: capture_ahead(full, shallow.inner, best))
    except NotLaidOut:
        return None
    if not result.ranked:
        raise InfeasibleError(_does_not_fit(options, space, shallow, cluster))
    planned: dict[int, Plan] = {}  # finalist's index -> its plan of the full model, where made
    for index, candidate in enumerate(result.ranked):
        fitting = [i for i, p in planned.items() if max(p.predicted.memory_bytes) <= cluster.memory_bytes]
        if not plan_every and fitting and candidate.step_s >= min(planned[i].predicted.modelled_step_s for i in fitting):
            break  # its estimate, and every later one's, is no faster than a plan already made
        layout = candidate.layout
        with _validation_beside(options, layout):  # validated while the full model is annotated
            front = _front_of(full, candidate)
            repeated = shallow.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
            if len(front.chain.blocks) != len(repeated):
                return None
            planned[index] = _plan_of(options, full, candidate)
    fitting = [i for i, p in planned.items() if max(p.predicted.memory_bytes) <= cluster.memory_bytes]
    if not fitting:
        return None
    # the finalists are ranked on the shallow copy's costs; where the full model's plan of the
    # first is slower than the next one's estimate, that one is planned too, and the faster kept
    best = min(fitting, key=lambda i: planned[i].predicted.modelled_step_s)
    chosen = result.ranked[best]
    plan, front = _refined(options, full, chosen, planned[best], time_limit_s=options.time_limit_s)
    order = [best, *(i for i in range(len(result.ranked)) if i != best)]  # the rows' finalists, the chosen first
    rows = [(chosen, plan.predicted.step_s, max(plan.predicted.memory_bytes))]
    rows += [(result.ranked[i], planned[i].predicted.step_s if i in planned else result.ranked[i].step_s,
              max(planned[i].predicted.memory_bytes) if i in planned else result.ranked[i].peak_memory_bytes)
             for i in order[1:]]  # fmt: skip
    estimated = {row for row, i in enumerate(order) if i not in planned}  # the shallow copy's figures alone
    plan = replace(plan, provenance=replace(plan.provenance, search=_summary(result, rows, estimated)))
    others = [Finalist(row=row, plan=planned[i], front=_front_of(full, result.ranked[i]))
              for row, i in enumerate(order) if row > 0 and i in fitting]
    return Searched(plan=plan, front=front, result=result, finalists=(Finalist(row=0, plan=plan, front=front), *others))


def capture_ahead(full: FrontTable, shallow: FrontTable, finalists: list[Scored]) -> None:
    """The full model's capture made while the workers score the shallow search's finalists, one
    of which is then planned on it: where they all have biases apart, or none has, and torch.fx
    captured the ``shallow`` copy (else it would most likely fail on the full model too)."""
    if len({scored.layout.tp > 1 for scored in finalists}) != 1:
        return
    first = finalists[0].layout
    if shallow.capture_method(tp=first.tp) == "fx":
        full.capture_ahead(micro_batch_size=first.micro_batch_size, tp=first.tp)


def _front_of(table: FrontTable, scored: Scored) -> Front:
    layout = scored.layout
    return table.front(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)


def _validation_beside(options: CompileOptions, layout: Layout) -> contextlib.AbstractContextManager:
    """The layout's schedule validated in a forked process while its plan is captured and
    predicted, unless the compile times this machine (`autopart.schedule.validation_beside`)."""
    return validation_beside(layout.schedule, layout.pp, layout.microbatches, layout.chunks,
                             fork=local_kind(options.device) is None)


def concrete_options(options: CompileOptions, layout: Layout, recompute: tuple[str, ...]) -> CompileOptions:
    """The options that pin every choice of ``layout`` and its stages' ``recompute``."""
    return replace(
        options, world_size=None, run_finalists=None, pp=layout.pp, tp=layout.tp, dp=layout.dp, zero=layout.zero,
        schedule=layout.schedule, chunks=layout.chunks, microbatches=layout.microbatches,
        micro_batch_size=None, global_batch_size=layout.microbatches * layout.micro_batch_size * layout.dp,
        recompute=recompute, dtype=layout.dtype, sp=sequence_parallel(options),
    )  # fmt: skip


def _plan_of(options: CompileOptions, table: FrontTable, scored: Scored) -> Plan:
    """``scored``'s plan with its cuts as the search's cutter made them: its solver status says
    so ("bisection"), with the latency bound and gap of those cuts ("trivial" for one stage)."""
    concrete = concrete_options(options, scored.layout, scored.recompute)
    with _validation_beside(options, scored.layout):
        front = _front_of(table, scored)
        batch = concrete.batch_shape()
        problem = pipeline_problem(concrete, front, batch[1])
        cuts = scored.cut.cuts
        solver = ("trivial", 0.0, 0.0) if scored.layout.stages == 1 else \
            _solver_figures("bisection", evaluate(problem, cuts).objective_s, _latency_bound(problem))
        return plan_from_cuts(concrete, front, problem, cuts, batch, solver)


def _refined(options: CompileOptions, table: FrontTable, best: Scored, scored_plan: Plan, *,
             time_limit_s: float) -> tuple[Plan, Front]:
    """The best layout's plan. Where the chain is small enough, CP-SAT minimises the pipeline
    latency from its cuts; its cuts are taken when the simulated step agrees they are faster,
    and its bound says how far from optimal the chosen cuts' latency can be."""
    layout = best.layout
    concrete = concrete_options(options, layout, best.recompute)
    front = _front_of(table, best)
    batch = concrete.batch_shape()
    problem = pipeline_problem(concrete, front, batch[1])
    cuts = best.cut.cuts
    if tuple(stage.blocks[0] - 1 for stage in scored_plan.stages[1:]) != cuts:  # not best's as `_plan_of` made it
        scored_plan = plan_from_cuts(concrete, front, problem, cuts, batch, ("search", 0.0, 0.0))
    if layout.stages == 1:
        return with_solver(scored_plan, ("trivial", 0.0, 0.0)), front
    bound, chosen = _latency_bound(problem), scored_plan
    if all(mode == "none" for mode in best.recompute) and len(front.chain.blocks) * layout.stages <= CP_SAT_LIMIT:
        solution = solve_cuts(problem, time_limit_s=time_limit_s, hint=cuts)
        bound = solution.bound_s
        if solution.evaluation.cuts != cuts:
            proposed = plan_from_cuts(concrete, front, problem, solution.evaluation.cuts, batch, ("", 0.0, 0.0))
            if proposed.predicted.modelled_step_s < scored_plan.predicted.modelled_step_s:
                cuts, chosen = solution.evaluation.cuts, proposed
        objective = evaluate(problem, cuts).objective_s
        status = solution.status if objective <= solution.evaluation.objective_s * (1 + 1e-9) else "feasible"
    else:
        objective, status = evaluate(problem, cuts).objective_s, "bisection"
    return with_solver(chosen, _solver_figures(status, objective, bound)), front


def _solver_figures(status: str, objective: float, bound: float) -> tuple[str, float, float]:
    """(status, bound, gap) as a plan records them for cuts of pipeline latency ``objective``:
    the bound no higher than that latency, the gap how far above the bound it may be."""
    gap = max(0.0, (objective - bound) / objective) if objective else 0.0
    return status, min(bound, objective), gap


def _latency_bound(problem) -> float:
    """No cuts have a lower pipeline latency: all the compute once, the largest share m - 1 more times."""
    total = sum(problem.block_time_s)
    slowest = max(total / problem.stages, max(problem.block_time_s))
    return total + (problem.microbatches - 1) * slowest


def _summary(result: SearchResult, rows: list[tuple[Scored, float, int]],
             estimated: Set[int] = frozenset()) -> dict:
    """The search in the plan's provenance; ``rows``: per finalist, best first, its step and peak
    memory; ``estimated``: the rows whose figures are the shallow copy's estimates, the full model
    not planned for them (its estimate is a bound on it, which is why it was not)."""
    return {
        "layouts": result.layouts,
        "scored": result.scored,
        "fitting": result.fitting,
        "seconds": round(result.seconds, 3),
        "ranked": [
            {"layout": s.layout.describe(), "recompute": list(s.recompute), "step_s": step_s, "memory_bytes": memory,
             **({"estimated": True} if row in estimated else {})}
            for row, (s, step_s, memory) in enumerate(rows)
        ],
    }


def _does_not_fit(options: CompileOptions, space: SearchSpace, table: FrontTable, cluster: Cluster) -> str:
    """One line: the smallest memory per device that some layout of this world size fits in, and
    the smallest world size (up to 64 times this one) that fits in this memory."""
    roomy = replace(cluster, memory_bytes=1 << 62)
    smallest = space.smallest_micro_batch_size()
    blocks = len(table.chain_costs(micro_batch_size=smallest, tp=1, dtype=space.dtype[0]))
    # a first figure from likely-lean layouts (the smallest microbatch, ZeRO where allowed, the model
    # split the most ways), one layout each; then the bisection over the whole space from it
    lean = [layout for layout in space.layouts(blocks) if layout.micro_batch_size == smallest
            and (layout.zero or layout.dp == 1 or 1 not in space.zero)]
    lean.sort(key=lambda layout: -layout.pp * layout.tp)
    needed = None
    for layout in lean[:8]:
        if score_layout(layout, table, roomy, space, fit_only=True) is not None:
            low = _smallest_memory(layout, table, cluster, space)
            needed = low if needed is None else min(needed, low)
    if needed is not None:  # other layouts (a larger microbatch, fewer stages) may fit in less
        needed = _smallest_fitting_memory(space, table, cluster, fits_at=needed)
    larger = None
    for factor in (2, 4, 8, 16, 32, 64):
        bigger = replace(space, world_size=space.world_size * factor)
        if fits(bigger, table, cluster):
            larger = bigger.world_size
            break
    fixes = []
    if needed is not None:
        fixes.append(f"--memory {gib_up(needed)} (GiB per device) or more")
    if larger is not None:
        fixes.append(f"--world-size {larger}")
    need = f"needs {gib_up(needed)} GiB per device" if needed is not None else "does not fit at any memory"
    return (
        f"the model does not fit on {space.world_size} devices of {cluster.memory_bytes / (1 << 30):.3g} GiB: "
        f"its leanest layout {need}; use {' or '.join(fixes) or 'a smaller model or batch'}"
    )


def _smallest_fitting_memory(space: SearchSpace, table: FrontTable, cluster: Cluster, *, fits_at: int) -> int:
    """Bisection on the memory limit over every layout of the space: the least that some layout
    fits in (to 64 KiB), given ``fits_at``, a limit that one fits in. Fitting only grows with memory."""
    lo, hi = cluster.overhead_bytes, fits_at
    while hi - lo > 1 << 16:
        mid = (lo + hi) // 2
        if fits(space, table, replace(cluster, memory_bytes=mid)):
            hi = mid
        else:
            lo = mid
    return hi


def _smallest_memory(layout: Layout, table: FrontTable, cluster: Cluster, space: SearchSpace) -> int:
    """Bisection on the memory limit: the least that ``layout`` fits in with full recompute."""
    lo, hi = cluster.overhead_bytes, 1 << 50
    while hi - lo > max(1 << 20, hi >> 10):  # to 0.1%
        mid = (lo + hi) // 2
        limited = replace(cluster, memory_bytes=mid)
        if may_fit(table, layout, limited) and score_layout(layout, table, limited, space, fit_only=True) is not None:
            hi = mid
        else:
            lo = mid
    return hi
