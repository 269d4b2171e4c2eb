"""Lower a compute-only schedule: insert the point-to-point sends and receives between ranks.

Each send goes right after the compute that produces the tensor and each receive right before
the compute that consumes it. With asynchronous sends (``isend``, never waited on before the
next action) and blocking receives, a receive then waits for exactly the data its next compute
would have waited for anyway, so the lowered schedule deadlocks if and only if the compute-only
schedule's dependencies do: a schedule that `validate` accepts stays deadlock-free. Placing a
receive late also keeps a rank from blocking on data it does not need yet.

Between two stages on the same rank nothing is inserted: the runtime hands the tensor over in
memory.
"""

from __future__ import annotations

from autopart.ir.errors import ScheduleError
from autopart.ir.actions import Action, Kind, Schedule, stage_rank

__all__ = ["add_communication"]


def add_communication(schedule: Schedule, *, ranks: int) -> Schedule:
    """A copy of ``schedule`` with SEND_F/RECV_F/SEND_B/RECV_B wherever a tensor changes rank.

    The number of stages is read off the schedule (the highest stage that appears, plus one).
    Raises ScheduleError when the input already holds communication, or when an action sits on
    a rank that `stage_rank` does not place its stage on (its peers would be wrong).
    """
    computes = [action for actions in schedule.values() for action in actions]
    if not computes:
        return {rank: [] for rank in schedule}
    last_stage = max(action.stage for action in computes)
    lowered: Schedule = {}
    for rank in sorted(schedule):
        out: list[Action] = []
        for step, action in enumerate(schedule[rank]):
            if not action.is_compute:
                raise ScheduleError(
                    f"rank {rank}, step {step}: {action} is already a communication action; "
                    "add_communication takes a compute-only schedule"
                )
            if stage_rank(action.stage, ranks) != rank:
                raise ScheduleError(
                    f"rank {rank}, step {step}: {action} belongs on rank "
                    f"{stage_rank(action.stage, ranks)} (stage {action.stage} with {ranks} ranks)"
                )
            out.extend(_receives(action, ranks=ranks, last_stage=last_stage))
            out.append(action)
            out.extend(_sends(action, ranks=ranks, last_stage=last_stage))
        lowered[rank] = out
    return lowered


def _crosses(stage: int, neighbour: int, ranks: int) -> bool:
    return stage_rank(stage, ranks) != stage_rank(neighbour, ranks)


def _receives(action: Action, *, ranks: int, last_stage: int) -> list[Action]:
    """The receive that must complete before ``action`` can run, if its input is remote."""
    stage, mb = action.stage, action.microbatch
    if action.kind is Kind.F and stage > 0 and _crosses(stage, stage - 1, ranks):
        return [Action(stage, Kind.RECV_F, mb)]
    if action.kind in (Kind.B, Kind.I) and stage < last_stage and _crosses(stage, stage + 1, ranks):
        return [Action(stage, Kind.RECV_B, mb)]
    return []


def _sends(action: Action, *, ranks: int, last_stage: int) -> list[Action]:
    """The send of ``action``'s output, if the stage that consumes it is remote."""
    stage, mb = action.stage, action.microbatch
    if action.kind is Kind.F and stage < last_stage and _crosses(stage, stage + 1, ranks):
        return [Action(stage, Kind.SEND_F, mb)]
    if action.kind in (Kind.B, Kind.I) and stage > 0 and _crosses(stage, stage - 1, ranks):
        return [Action(stage, Kind.SEND_B, mb)]
    return []
