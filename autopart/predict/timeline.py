"""Predicted figures of a plan, from the same schedule lists that the runtime executes."""

from __future__ import annotations

from autopart.ir.plan import Plan
from autopart.schedule import Schedule, StageCosts, Timeline, add_communication, build_schedule, simulate, validate

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
    schedule = add_communication(build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks), ranks=ranks)
    validate(schedule, ranks=ranks, stages=len(forward_s), microbatches=microbatches)
    costs = StageCosts(forward_s=forward_s, backward_s=backward_s, weight_s=weight_s, transfer_s=transfer_s)
    return simulate(schedule, costs, ranks=ranks)


def plan_schedule(plan: Plan, *, lowered: bool = True) -> Schedule:
    spec = plan.schedule
    schedule = build_schedule(spec.kind, ranks=plan.mesh["pp"], microbatches=spec.microbatches, chunks=spec.chunks)
    return add_communication(schedule, ranks=plan.mesh["pp"]) if lowered else schedule


def plan_timeline(plan: Plan) -> Timeline:
    stages = plan.stages
    return simulate_pipeline(
        kind=plan.schedule.kind,
        ranks=plan.mesh["pp"],
        microbatches=plan.schedule.microbatches,
        chunks=plan.schedule.chunks,
        forward_s=tuple(s.forward_s for s in stages),
        backward_s=tuple(s.backward_s for s in stages),
        weight_s=tuple(s.backward_weight_s for s in stages),
        transfer_s=plan.predicted.transfer_s,
    )
