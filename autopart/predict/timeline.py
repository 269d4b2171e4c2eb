"""Predicted figures of a plan, from the same schedule lists that the runtime executes."""

from __future__ import annotations

import functools

from autopart.ir.plan import Plan
from autopart.schedule import Schedule, StageCosts, Timeline, add_communication, build_schedule, simulate, validate

__all__ = ["simulate_pipeline", "lowered_schedule", "plan_schedule", "plan_timeline"]


@functools.lru_cache(maxsize=16)
def lowered_schedule(kind: str, ranks: int, microbatches: int, chunks: int) -> Schedule:
    """The schedule with its sends and receives, validated; built once per shape, because a compile
    simulates one pipeline several times (each candidate plan, its step, the report) and at a
    thousand microbatches over hundreds of virtual stages building and validating it costs more
    than simulating it. Shared between callers: read it, never change it."""
    schedule = add_communication(build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks),
                                 ranks=ranks)
    validate(schedule, ranks=ranks, stages=ranks * chunks, microbatches=microbatches)
    return schedule


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
    schedule = lowered_schedule(kind, ranks, microbatches, chunks)
    if len(forward_s) != ranks * chunks:  # costs of stages the schedule has not: the validator says which
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
