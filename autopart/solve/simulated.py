"""A layout's step by the schedule simulator instead of the closed form: ranks the finalists.

The search estimates thousands of layouts in closed form (``autopart.solve.closed_form.estimate_step_s``:
``sum T_s + (m - 1) max T_s`` and the like, each stage's time counting its transfers). Here a
scored layout is run action by action on its own schedule (``autopart.schedule.build_schedule``,
the generator the compiler emits, virtual stages for interleaved) with the block-level chain
costs of its stages (under ZeRO-2/3 with FSDP's collectives). The data-parallel all-reduces
run beside each rank's remaining actions where the device overlaps them (ZeRO 0 and 1), as the
step model runs them; otherwise the closed form's tail (``autopart.solve.data_parallel_tail``)
is added after the pipeline drains:

- forward: the stage's blocks' ``forward_s``;
- backward: their ``backward_s`` plus the forward work the stage's recompute mode repeats (the
  extra that ``autopart.solve.bottleneck`` counts: ``selective_recompute_s`` for selective, the
  whole forward for full); weight: their ``weight_s`` (zb-h1's W);
- transfer: per boundary, `autopart.solve.transfers.boundary_transfer_s` (each tensor-parallel
  rank's share over the link, then any all-gather), as ``score_layout`` takes it; here it is
  latency on the message, overlapped with other work, where the closed form adds it to both
  stages' time; the gradient back only over a boundary where one comes (`ChainCosts.boundary_gradients`).

Where the closed form is exact (gpipe and 1f1b with equal stages and no transfer) the two agree;
elsewhere the simulator is the better judge (unequal stages under interleaving, zb-h1's W filling
the cool-down, transfers hidden behind compute). Costs and the schedule are plain data, so the
pipeline part is memoised per (schedule, stage costs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autopart.ir.actions import Kind
from autopart.schedule import SPLIT_BACKWARD_KINDS, StageCosts, built, simulated_events, stage_placement
from autopart.solve.replica_shares import parameter_bytes_per_rank, rank_spans, slowest_replica_bytes, trained_bytes
from autopart.solve.search import Cluster, CostTable, Scored
from autopart.solve.baselines import stage_parameter_bytes
from autopart.solve.chain_costs import ChainCosts, chain_sums
from autopart.solve.data_parallel_tail import (fully_sharded_extra_s, last_bucket_bytes, layered_pending_s,
                                               stage_layers, tail_s, update_s)
from autopart.solve.transfers import boundary_transfer_s
from autopart.predict.reduction import collectives_delay
from cost_models.comm import NodeSpan

__all__ = ["simulated_step_s", "simulated_stage_costs", "pipeline_s"]


def simulated_step_s(scored: Scored, table: CostTable, cluster: Cluster) -> float:
    """The step of ``scored`` (its layout, cuts and recompute per stage) by simulation: the
    schedule's pipeline, then the gradient all-reduce and optimizer step of the busiest rank.
    Where the collectives overlap the compute (ZeRO 0 or 1), each rank's reductions run beside
    its own remaining actions as the simulated timeline has them (`_overlapped_step_s`)."""
    layout, cut = scored.layout, scored.cut
    costs, pending = _stage_costs(scored, table, cluster)
    chain = table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
    ranks = stage_placement(layout.schedule, ranks=layout.pp, chunks=layout.chunks)
    rank_bytes = parameter_bytes_per_rank(table, layout, cut, ranks)
    dp_span = layout.data_parallel_span(cluster.gpus_per_node)
    stepped = slowest_replica_bytes(layout, chain)
    spans = rank_spans(cut.cuts, len(chain), ranks)
    stepped_bytes = None if stepped is None else [stepped(mine) for mine in spans]
    trained = [trained_bytes(chain, mine) for mine in spans]  # what each rank reduces and steps
    if layout.dp > 1 and int(layout.zero) in (0, 1) and cluster.reduction_overlaps:
        return _overlapped_step_s(layout, cluster, chain, cut.cuts, costs, trained, dp_span, stepped_bytes)
    pipeline = pipeline_s(layout.schedule, layout.pp, layout.microbatches, layout.chunks, costs)
    behind = [0.0] * layout.pp  # per rank, its last microbatch's backward: what its all-reduce runs beside
    for rank, backward in zip(ranks, costs.backward_s):
        behind[rank] += backward
    return pipeline + tail_s(layout, cluster, rank_bytes, dp_span, behind, last_bucket_bytes(layout, chain, cut.cuts),
                             stepped_bytes, trained, pending)


def _overlapped_step_s(layout, cluster: Cluster, chain: ChainCosts, cuts: tuple[int, ...], costs: StageCosts,
                       reduced_bytes: list[int], dp_span: NodeSpan, stepped_bytes: list[int] | None) -> float:
    """The step with each rank's gradient all-reduces queued on its communicator as the runtime
    launches them (`autopart.predict.reduction`, at stage grain): a stage's parameters but its
    first block's are ready from the start of its last backward (B, or W where the backward is
    split; the backward reaches the later blocks first), its first block's at that action's end.
    Under interleaving a rank's chunks finish at different times of the cool-down, so the
    reductions of the first to finish run beside the others' backwards. ``reduced_bytes``: per rank,
    the bytes of its parameters that train, all that it reduces and steps."""
    run = _run(layout.schedule, layout.pp, layout.microbatches, layout.chunks, costs)
    ends, final = run.ends, run.final
    firsts, lasts = (0, *(c + 1 for c in cuts)), (*cuts, len(chain) - 1)
    queued: list[list[tuple[float, int]]] = [[] for _ in range(layout.pp)]  # per rank, (ready at, bytes)
    for stage, rank in enumerate(stage_placement(layout.schedule, ranks=layout.pp, chunks=layout.chunks)):
        start, end = final.get(stage, (0.0, 0.0))
        whole = trained_bytes(chain, ((firsts[stage], lasts[stage]),))  # what has a gradient
        first = trained_bytes(chain, ((firsts[stage], firsts[stage]),))
        queued[rank] += [(start, whole - first), (end, first)]
    step = 0.0
    for rank, items in enumerate(queued):
        items = sorted((ready, nbytes) for ready, nbytes in items if nbytes)
        delay, wait = collectives_delay([ready for ready, _ in items],
                                        [(cluster.all_reduce_s(nbytes, layout.dp, dp_span), 0.0) for _, nbytes in items],
                                        ends[rank], slowdown=cluster.overlap_slowdown)
        stepped = None if stepped_bytes is None else stepped_bytes[rank]
        step = max(step, ends[rank] + delay + wait + update_s(layout, cluster, reduced_bytes[rank], dp_span, stepped))
    return step


def simulated_stage_costs(scored: Scored, table: CostTable, cluster: Cluster) -> StageCosts:
    """Per stage of ``scored.cut``, its blocks' summed costs in its recompute mode; per boundary,
    the point-to-point time of what crosses it."""
    return _stage_costs(scored, table, cluster)[0]


def _stage_costs(scored: Scored, table: CostTable, cluster: Cluster) -> tuple[StageCosts, list[float] | None]:
    """`simulated_stage_costs`, and at ZeRO-3 per rank what its reduce-scatters run past its last
    backward (`autopart.solve.data_parallel_tail.layered_pending_s`, the longest of its stages')."""
    layout, cut = scored.layout, scored.cut
    costs = table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
    if layout.schedule not in SPLIT_BACKWARD_KINDS:  # full recompute layer by layer, as the search counted it
        costs = costs.checkpointing_layers()
    firsts = [0, *(c + 1 for c in cut.cuts)]
    ends = [*(c + 1 for c in cut.cuts), len(costs)]
    forward, backward, weight = costs.prefix("forward_s"), costs.prefix("backward_s"), costs.prefix("weight_s")
    forward_s, backward_s, weight_s = [], [], []
    placement = stage_placement(layout.schedule, ranks=layout.pp, chunks=layout.chunks)
    pending = [0.0] * layout.pp if int(layout.zero) == 3 else None
    data_parallel_span = layout.data_parallel_span(cluster.gpus_per_node)
    for rank, first, end, mode, layers in zip(placement, firsts, ends, cut.recompute, stage_layers(costs, cut.cuts),
                                              strict=True):
        stage_forward = forward[end] - forward[first]
        stage_backward = backward[end] - backward[first] + _recompute_s(costs, mode, first, end)
        held = stage_parameter_bytes(costs, first, end - 1)
        trained = trained_bytes(costs, ((first, end - 1),)) / held if held else 1.0
        arguments = dict(dp=layout.dp, dp_span=data_parallel_span, dtype=layout.dtype, backward_s=stage_backward,
                         layers=layers, trained=trained)
        gather, reduce = fully_sharded_extra_s(int(layout.zero), cluster, held, stage_forward, **arguments)
        if pending is not None:
            pending[rank] = max(pending[rank], layered_pending_s(cluster, held, stage_forward, **arguments))
        forward_s.append(stage_forward + gather)
        backward_s.append(stage_backward + reduce)
        weight_s.append(weight[end] - weight[first])
    transfers = boundary_transfer_s(costs, layout, cluster)
    transfer_s = tuple(transfers[c] for c in cut.cuts)
    gradients = tuple(costs.boundary_gradients[c] for c in cut.cuts) if costs.boundary_gradients else ()
    return StageCosts(forward_s=tuple(forward_s), backward_s=tuple(backward_s), weight_s=tuple(weight_s),
                      transfer_s=transfer_s, gradients=gradients), pending


def _recompute_s(costs: ChainCosts, mode: str, first: int, end: int) -> float:
    """Forward work that ``mode`` repeats in the backward of blocks ``first..end-1``."""
    sums = chain_sums(costs)
    return sums.seconds(first, end - 1, mode) - sums.seconds(first, end - 1, "none")


def pipeline_s(kind: str, pp: int, microbatches: int, chunks: int, costs: StageCosts) -> float:
    """The simulated pipeline of one step: first forward's start to last backward's end.

    The schedule is the compute-only one: ``add_communication`` puts each receive right before
    its consumer and sends and receives take no rank time here, so lowering changes no time."""
    return _run(kind, pp, microbatches, chunks, costs).step_s


@dataclass(frozen=True)
class _Run:
    """What the search reads of a simulated pipeline (its `Timeline` less the events)."""

    step_s: float  # first start to last end
    ends: tuple[float, ...]  # per rank, its last action's end
    final: dict[int, tuple[float, float]]  # per stage, its last weight-gradient action's (start, end)


@functools.lru_cache(maxsize=4096)
def _run(kind: str, pp: int, microbatches: int, chunks: int, costs: StageCosts) -> _Run:
    schedule, placement = built(kind, pp, microbatches, chunks)  # the plan's own, once chosen
    events = simulated_events(schedule, costs, ranks=pp, placement=placement)
    origin = min((start for _, _, start, _ in events), default=0.0)  # times from the first start, as a Timeline's
    ends = [0.0] * pp
    final: dict[int, tuple[float, float]] = {}
    for rank, action, start, end in events:
        start, end = start - origin, end - origin
        if end > ends[rank]:
            ends[rank] = end
        if action.kind is Kind.B or action.kind is Kind.W:  # the last to end; of those, the last to start
            previous = final.get(action.stage)
            if previous is None or (end, start) >= (previous[1], previous[0]):
                final[action.stage] = (start, end)
    return _Run(step_s=max(ends), ends=tuple(ends), final=final)
