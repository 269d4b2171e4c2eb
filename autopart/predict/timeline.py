"""Predicted figures of a plan, from the same schedule lists that the runtime executes."""

from __future__ import annotations

import functools

from autopart.ir.plan import Plan, gradient_boundaries
from autopart.schedule import Schedule, StageCosts, Timeline, built, generated, plan_actions, simulate, validate

__all__ = ["simulate_pipeline", "plan_schedule", "plan_timeline"]


def simulate_pipeline(
    *,
    kind: str,
    ranks: int,
    microbatches: int,
    chunks: int,
    forward_s: tuple[float, ...],
    backward_s: tuple[float, ...],
    weight_s: tuple[float, ...],
    transfer_s: tuple[float, ...],
) -> Timeline:
    """The pipeline's compute on its schedule: its messages take no rank time here, so the compute
    order alone times as its lowering would (`autopart.schedule.simulate`)."""
    if len(forward_s) != ranks * chunks:  # costs of stages the schedule has not: the validator says which
        schedule, placement = built(kind, ranks, microbatches, chunks)
        validate(schedule, ranks=ranks, stages=len(forward_s), microbatches=microbatches, placement=placement)
    costs = StageCosts(forward_s=forward_s, backward_s=backward_s, weight_s=weight_s, transfer_s=transfer_s)
    return _simulated(kind, ranks, microbatches, chunks, costs)


@functools.lru_cache(maxsize=2)
def _simulated(kind: str, ranks: int, microbatches: int, chunks: int, costs: StageCosts) -> Timeline:
    """A generated schedule's timeline: a compile asks for its plan's twice (the plan's figures,
    the report), each a simulation of up to a million actions. Shared: read it."""
    schedule, placement = built(kind, ranks, microbatches, chunks)
    return simulate(schedule, costs, ranks=ranks, placement=placement)


def plan_schedule(plan: Plan, *, lowered: bool = True) -> Schedule:
    """The plan's stored action lists, validated (`autopart.schedule.plan_actions`)."""
    return plan_actions(plan, lowered=lowered)


def plan_timeline(plan: Plan) -> Timeline:
    """The plan's own action lists (hand-edited ones included) run against its stage times, each
    forward and backward with the data-parallel collectives that run inside it (ZeRO-2/3), as the
    plan's pipeline was timed; its compute order alone, as in `simulate_pipeline`."""
    stages = plan.stages
    collectives = plan.predicted.collective_s or ((0.0, 0.0),) * len(stages)
    costs = StageCosts(
        forward_s=tuple(s.forward_s + c[0] for s, c in zip(stages, collectives)),
        backward_s=tuple(s.backward_s + c[1] for s, c in zip(stages, collectives)),
        weight_s=tuple(s.backward_weight_s for s in stages),
        transfer_s=plan.predicted.transfer_s,
        gradients=gradient_boundaries(stages),
    )
    placement, spec, ranks = tuple(s.rank for s in stages), plan.schedule, plan.mesh["pp"]
    schedule = plan_schedule(plan, lowered=False)
    if schedule is generated(spec.kind, ranks, spec.microbatches, spec.chunks).compute:  # its kind's, unedited
        return _simulated(spec.kind, ranks, spec.microbatches, spec.chunks, costs)
    return simulate(schedule, costs, ranks=ranks, placement=placement)
