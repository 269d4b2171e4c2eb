"""The data-parallel all-reduce in the step model, overlapped with the backward exactly as the
runtime overlaps it (`autopart.runtime.reducer`).

Each rank reduces its gradients in the runtime's buckets (`autopart.ir.buckets.plan_buckets`), one after another on
its communicator, each launched once its gradients are final: inside the stage's last B, when
autograd has written the bucket's parameters (the backward runs from the stage's last block to
its first, so a bucket of the last blocks is final after their share of the B), or at the end
of its last W. When that is comes from the step model's own timeline of the rank's actions
(`autopart.schedule.shared.step_time`, ``events``); only what the reductions still run after the
rank's last action adds to its step, before its tail (the runtime waits for them there).

On a device whose cores the ranks share (a CPU, gloo), a reduction is work of the rank's cores
too: gloo's threads copy and add the bytes. Its share of a core is the part of a message's time
that its two processes spend on the CPU (``profile-comm``'s ``p2p_send_cpu`` and
``p2p_recv_cpu`` against ``p2p``), and while it runs beside the compute the two share the
rank's cores (processor sharing, as `step_time` shares them between ranks): the compute takes
longer by what the reduction took from it, and the reduction runs slower. On a device of each
rank's own (a GPU: NCCL's kernels and the NICs move the bytes) a reduction keeps its pace and
the compute beside it runs slower by the device's ``overlap_compute_slowdown`` (NCCL's kernels
hold SMs and memory bandwidth meanwhile).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from autopart.ir.actions import Action, Kind, Schedule
from autopart.ir.buckets import final_gradient_positions, plan_buckets
from autopart.ir.plan import StagePlan
from autopart.passes.blocks import BlockChain
from autopart.schedule import StageCosts
from autopart.schedule.shared import dedicated_run, step_time
from cost_models import CostModel

__all__ = ["Reduction", "StageGradients", "rank_reductions", "plan_reductions", "reduction_delay",
           "collectives_delay", "overlapped_step_time"]

_EPSILON = 1e-12


@dataclass(frozen=True, kw_only=True)
class Reduction:
    """One bucket's all-reduce on one rank."""

    trigger: Action
    """The action after (or inside) which its gradients are final: the stage's last B or W."""
    fraction: float
    """Of ``trigger``, the part done when they are: 1 at its end."""
    seconds: float
    """Its time alone, on a quiet machine."""
    cpu_share: float = 0.0
    """The part of ``seconds`` that is work of the rank's cores (0 to 1)."""


@dataclass(frozen=True, kw_only=True)
class StageGradients:
    """A stage's parameters as the reduction sees them."""

    stage: int
    parameters: tuple[tuple[str, int], ...]
    """(name, bytes on one rank) in forward order, as the plan lists them."""
    final_after: Mapping[str, float]
    """Per parameter, the part of the stage's B done when its gradient is final."""


def rank_reductions(actions: Sequence[Action], stages: Sequence[StageGradients], *,
                    seconds: Callable[[int], tuple[float, float]]) -> list[Reduction]:
    """The reductions of one rank, in launch order. ``actions``: the rank's list; ``stages``:
    those it holds; ``seconds(nbytes)``: a bucket's time alone and the share of it on the cores."""
    final = final_gradient_positions(actions)
    held = {s.stage: s for s in stages}
    order = sorted(held, key=lambda stage: final[stage])
    reductions = []
    for bucket in plan_buckets([(s, held[s].parameters) for s in order]):
        trigger = actions[final[bucket.stage]]
        whole = trigger.kind is Kind.B  # W writes its gradients by hand, all at its end
        fraction = max(held[bucket.stage].final_after[n] for n in bucket.names) if whole else 1.0
        alone, share = seconds(bucket.nbytes)
        reductions.append(Reduction(trigger=trigger, fraction=fraction, seconds=alone, cpu_share=share))
    return reductions


def plan_reductions(schedule: Schedule, stages: Sequence[StagePlan], chain: BlockChain,
                    backward_s: Sequence[float], *, tp: int, dp: int, cost_model: CostModel,
                    nodes: int, members: int | None = None) -> dict[int, list[Reduction]]:
    """Per pipeline rank, the reductions of a plan's stages: ``backward_s`` per block (its share
    of its stage's B), each parameter's bytes on a rank (a tensor-parallel shard's where the
    plan splits it), the all-reduce over ``dp`` replicas on ``nodes`` nodes (``members`` of them on the node
    holding the fewest, `cost_models.comm.fewest_members`) as ``cost_model`` times it."""
    if dp == 1:
        return {}

    def seconds(nbytes: int) -> tuple[float, float]:
        alone = cost_model.collective_time("all_reduce", nbytes, dp, nodes=nodes, members=members)
        piece = nbytes / dp  # a ring all-reduce moves the bytes in dp pieces, 2 (dp - 1) times each way
        send, receive = cost_model.p2p_rank_time(piece, across_nodes=nodes > 1)
        message = cost_model.p2p_time(piece, across_nodes=nodes > 1)
        return alone, min(1.0, (send + receive) / message) if message > 0 else 0.0

    found: dict[int, list[StageGradients]] = {}
    for stage in stages:
        first, last = stage.blocks
        total = sum(backward_s[first:last + 1])
        after: dict[str, float] = {}
        for k in range(last, first - 1, -1):  # the backward runs from the last block to the first
            done = sum(backward_s[k:last + 1]) / total if total > 0 else 1.0
            after.update({p: done for p in chain.blocks[k].parameters if p in stage.parameters})
        sizes = tuple((p, chain.parameter_bytes[p] // (tp if p in stage.parameter_placements else 1))
                      for p in stage.parameters if p not in chain.frozen_parameters)  # no gradient to reduce
        found.setdefault(stage.rank, []).append(StageGradients(stage=stage.index, parameters=sizes, final_after=after))
    return {rank: rank_reductions(schedule[rank], held, seconds=seconds) for rank, held in found.items()}


def _rate(cores: float, busy: float) -> float:
    """A thread's speed when ``busy`` threads share ``cores`` (0 cores: one each; nothing busy:
    a reduction that takes no CPU runs beside no compute)."""
    return 1.0 if cores <= 0 or busy <= 0 else min(1.0, cores / busy)


def reduction_delay(ready: Sequence[float], reductions: Sequence[Reduction], compute_end: float, *,
                    cores: float = 0.0, busy: float = 1.0, slowdown: float = 0.0) -> tuple[float, float]:
    """Of one rank: how much later its compute ends for the reductions beside it (their work on
    its cores, or their slowdown of its device), and how long after that the last reduction ends
    (0 when it ended first).

    ``ready``: when each reduction's gradients are final, in seconds of the rank's timeline
    without them (so is ``compute_end``, its last action's end); ``busy``: the threads that share
    ``cores`` with the rank's compute (itself included). The reductions run one at a time, in
    order; while one runs beside the compute, it is ``cpu_share`` of one more thread. On a device
    of its own (``cores`` 0) the rank's compute runs ``slowdown`` slower while a reduction runs
    beside it (the device's ``overlap_compute_slowdown``: the collective's kernels hold SMs).

    The rank's timeline from a reduction's start to ``compute_end`` is taken as compute
    throughout, its waits too (a pipeline rank waits in the cool-down), and what it is delayed
    by is added to its own step alone, not to the ranks it sends to: the first overcharges a
    rank that waits beside a reduction, the second undercharges the ranks after a slowed one."""
    return collectives_delay(ready, [(r.seconds, r.cpu_share) for r in reductions], compute_end,
                             cores=cores, busy=busy, slowdown=slowdown)


def collectives_delay(ready: Sequence[float], collectives: Sequence[tuple[float, float]], compute_end: float, *,
                      cores: float = 0.0, busy: float = 1.0, slowdown: float = 0.0) -> tuple[float, float]:
    """`reduction_delay` of collectives given as (seconds alone, share of them on the cores)."""
    now = progress = 0.0  # real time; how far the rank's own timeline has got
    compute_done = None if compute_end > 0 else 0.0
    alone = _rate(cores, busy)
    for moment, (seconds, share) in zip(ready, collectives, strict=True):
        if progress < moment:  # nothing runs beside the compute until the gradients are final
            now, progress = now + moment - progress, moment
            if compute_done is None and progress >= compute_end - _EPSILON:
                compute_done = now
        left = 1.0  # of this reduction
        while left > _EPSILON:
            computing = compute_done is None
            if cores > 0:
                rate = _rate(cores, (busy if computing else busy - 1) + share)
                duration = seconds * ((1 - share) + share / rate)  # this reduction at this rate
            else:  # a device of its own: the compute slows beside it, the collective keeps its pace
                rate = 1.0 / (1.0 + slowdown) if computing else 1.0
                duration = seconds
            if duration <= 0:
                break
            step = left * duration
            if computing:
                step = min(step, (compute_end - progress) * alone / rate)
            now += step
            left -= step / duration
            if computing:
                progress += step * rate / alone
                if progress >= compute_end - _EPSILON:
                    compute_done = now
    if compute_done is None:
        compute_done = now + compute_end - progress
    return compute_done - compute_end, max(0.0, now - compute_done)


def overlapped_step_time(schedule: Schedule, costs: StageCosts, reductions: Mapping[int, Sequence[Reduction]], *,
                         ranks: int, tail_s: Mapping[int, float] | None = None, cores: int = 0,
                         background: float = 0.0, slowdown: float = 0.0,
                         **sharing) -> tuple[float, dict[int, tuple[float, float]]]:
    """`step_time` with each rank's reductions before its tail; and per rank what they added:
    the delay of its compute (`reduction_delay`, ``slowdown`` its slowdown beside them on a device
    of its own) and the wait past its last action. ``sharing``: `step_time`'s other arguments."""
    tail_s = dict(tail_s or {})
    if not any(reductions.values()):
        return step_time(schedule, costs, ranks=ranks, cores=cores, background=background, tail_s=tail_s,
                         **sharing), {}
    events: list[tuple[int, Action, float, float]] = []
    if cores <= 0:  # a device per rank: the tails follow the pipeline and change none of it, so it runs once
        inspect.signature(step_time).bind_partial(**sharing)  # its names checked as step_time would
        run = dedicated_run(schedule, costs, ranks=ranks, wake_s=sharing.get("wake_s"), events=events,
                            placement=sharing.get("placement"))
        step_with = run.step
    else:
        step_time(schedule, costs, ranks=ranks, cores=cores, background=background, tail_s=tail_s, events=events,
                  **sharing)

        def step_with(tails: Mapping[int, float]) -> float:
            return step_time(schedule, costs, ranks=ranks, cores=cores, background=background, tail_s=dict(tails),
                             **sharing)
    # only the triggers' spans are read: a long pipeline's events are a million, its triggers a
    # few per rank, and a dict of every (rank, action) took seconds to hash
    wanted = {(rank, reduction.trigger) for rank, mine in reductions.items() for reduction in mine}
    microbatches = {action.microbatch for _, action in wanted}  # a cheaper test first
    spans: dict[tuple[int, Action], tuple[float, float]] = {}
    last_end: dict[int, float] = {}
    for rank, action, start, end in events:
        if end > last_end.get(rank, -math.inf):
            last_end[rank] = end
        if action.microbatch in microbatches and (rank, action) in wanted:
            spans[rank, action] = (start, end)
    added = {}
    for rank, mine in reductions.items():
        ready = []
        for reduction in mine:
            start, end = spans.get((rank, reduction.trigger), (0.0, 0.0))
            ready.append(start + (end - start) * reduction.fraction)
        # the step's own threads share the cores; a collective's measured time already holds what
        # the rest of the machine took from it while it was measured
        added[rank] = reduction_delay(ready, mine, last_end.get(rank, 0.0), cores=cores, busy=ranks, slowdown=slowdown)
    return step_with({r: tail_s.get(r, 0.0) + sum(added.get(r, ())) for r in schedule}), added
