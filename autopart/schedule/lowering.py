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
from collections.abc import Sequence

from autopart.ir.actions import Action, Kind, Schedule, rank_of

__all__ = ["add_communication"]


def add_communication(schedule: Schedule, *, ranks: int, placement: Sequence[int] | None = None) -> Schedule:
    """A copy of ``schedule`` with SEND_F/RECV_F/SEND_B/RECV_B wherever a tensor changes rank.

    The number of stages is read off the schedule (the highest stage that appears, plus one).
    Raises ScheduleError when the input already holds communication, or when an action sits on
    a rank that ``placement`` (stage -> rank; `stage_rank`'s loop without one) does not place its
    stage on (its peers would be wrong).
    """
    computes = [action for actions in schedule.values() for action in actions]
    if not computes:
        return {rank: [] for rank in schedule}
    last_stage = max(action.stage for action in computes)
    # per stage, once: its rank, and whether its neighbours are elsewhere (a long pipeline's
    # schedule holds a million actions, each asking the same few questions of its stage); asked
    # where the action-by-action rule asked them, so a bad input fails with the same error
    home: dict[int, int] = {}
    crossing: dict[int, tuple[bool, bool]] = {}  # stage -> (input from another rank, output to another)

    def home_of(stage: int) -> int:
        if stage not in home:
            home[stage] = rank_of(stage, ranks, placement)
        return home[stage]

    def crossings(stage: int) -> tuple[bool, bool]:
        if stage not in crossing:
            crossing[stage] = (stage > 0 and home_of(stage - 1) != home_of(stage),
                               stage < last_stage and home_of(stage + 1) != home_of(stage))
        return crossing[stage]

    forward, backward = Kind.F, (Kind.B, Kind.I)
    lowered: Schedule = {}
    for rank in sorted(schedule):
        out: list[Action] = []
        append = out.append
        for step, action in enumerate(schedule[rank]):
            kind, stage, mb = action.kind, action.stage, action.microbatch
            if not kind.is_compute:
                raise ScheduleError(
                    f"rank {rank}, step {step}: {action} is already a communication action; "
                    "add_communication takes a compute-only schedule"
                )
            if home_of(stage) != rank:
                raise ScheduleError(
                    f"rank {rank}, step {step}: {action} belongs on rank {home[stage]} (stage {stage} with {ranks} ranks)"
                )
            if kind is not forward and kind not in backward:  # W: nothing crosses
                append(action)
                continue
            # a receive right before the compute that needs remote input, a send right after
            # the compute whose output a remote stage reads: a forward's input comes from the
            # stage before and goes to the one after, a backward's the other way
            from_before, to_after = crossings(stage)
            receive, send = (from_before, to_after) if kind is forward else (to_after, from_before)
            if receive:
                append(Action(stage, Kind.RECV_F if kind is forward else Kind.RECV_B, mb))
            append(action)
            if send:
                append(Action(stage, Kind.SEND_F if kind is forward else Kind.SEND_B, mb))
        lowered[rank] = out
    return lowered
