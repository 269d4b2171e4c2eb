"""Check that a schedule trains correctly and cannot hang, before any process runs it.

A bad schedule on a real cluster either hangs every rank silently or computes wrong gradients;
here it fails in one process with a one-line message that names the rank, the step and the
action, and with the whole schedule grid (`format_grid`) attached to the exception as ``grid``,
the failing step marked ``<-- ERROR HERE``, in the manner of torch.distributed.pipelining.

The checks run in the order that gives the most direct message: placement and ranges, then
each (stage, microbatch) runs exactly one forward and one backward, then the order of
dependent actions on one rank, then sends and receives pair up, and last a simulation of all
ranks with blocking receives and asynchronous sends that finds any deadlock.
"""

from __future__ import annotations

from autopart.ir.errors import ScheduleError
from autopart.ir.actions import RECEIVE_KINDS, Action, Kind, Schedule, stage_rank

__all__ = ["validate", "format_grid"]

_Key = tuple[int, Kind, int]  # (stage, kind, microbatch): what an action does, wherever it runs
_Where = tuple[int, int]  # (rank, step): where it runs

_ERROR_MARK = "<-- ERROR HERE"


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None) -> str:
    """The schedule as a table: ranks as columns, steps as rows.

    ``mark=(rank, step)`` appends ``<-- ERROR HERE`` to that step's row and names the rank, so
    a runtime failure can point at the action that failed.
    """
    if not schedule:
        return "(empty schedule)\n"
    rank_ids = list(range(max(schedule) + 1))
    steps = max((len(actions) for actions in schedule.values()), default=0)
    columns = [[str(a) for a in schedule.get(rank, [])] for rank in rank_ids]
    headers = [f"Rank {rank}" for rank in rank_ids]
    widths = [
        max([len(h), *(len(c) for c in col)]) for h, col in zip(headers, columns, strict=True)
    ]
    label_width = len(f"Step {steps - 1}") if steps else len("Step 0")
    digits = label_width - len("Step ")
    header = " " * (label_width + 2) + " ".join(
        h.ljust(w) for h, w in zip(headers, widths, strict=True)
    )
    lines = [header.rstrip()]
    for step in range(steps):
        cells = [
            (col[step] if step < len(col) else "").ljust(width)
            for col, width in zip(columns, widths, strict=True)
        ]
        line = f"Step {step:0{digits}d}: " + " ".join(cells)
        if mark is not None and mark[1] == step:
            line = line.rstrip() + f"  {_ERROR_MARK} (rank {mark[0]})"
        lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


def validate(schedule: Schedule, *, ranks: int, stages: int, microbatches: int) -> None:
    """Raise ScheduleError unless ``schedule`` runs every forward and backward once, in an
    order that respects the data dependencies, without a deadlock.

    The schedule may be compute-only or lowered by `add_communication`; it counts as lowered
    as soon as it holds one send or receive, and then every tensor that changes rank must go
    through a matching SEND/RECV pair.
    """
    where = _place_actions(schedule, ranks=ranks, stages=stages, microbatches=microbatches)
    _check_counts(schedule, where, stages=stages, microbatches=microbatches)
    lowered = any(not a.is_compute for actions in schedule.values() for a in actions)
    _check_order(schedule, where, ranks=ranks, stages=stages, lowered=lowered)
    _check_deadlock(schedule, where, ranks=ranks, stages=stages, lowered=lowered)


def _fail(message: str, schedule: Schedule, mark: _Where | None = None) -> ScheduleError:
    error = ScheduleError(message)
    error.grid = format_grid(schedule, mark)  # type: ignore[attr-defined]
    return error


def _key(action: Action) -> _Key:
    return (action.stage, action.kind, action.microbatch)


def _place_actions(
    schedule: Schedule, *, ranks: int, stages: int, microbatches: int
) -> dict[_Key, _Where]:
    """Where each action runs; fails on a foreign rank, index out of range or a repeat."""
    where: dict[_Key, _Where] = {}
    for rank in sorted(schedule):
        if not 0 <= rank < ranks:
            raise _fail(
                f"the schedule has rank {rank} but the pipeline has {ranks} ranks", schedule
            )
        for step, action in enumerate(schedule[rank]):
            at = f"rank {rank}, step {step}: {action}"
            if not isinstance(action, Action):
                raise _fail(f"{at} is not an Action", schedule, (rank, step))
            if action.stage >= stages:
                raise _fail(
                    f"{at} names stage {action.stage} but the pipeline has {stages} stages",
                    schedule,
                    (rank, step),
                )
            if action.microbatch >= microbatches:
                raise _fail(
                    f"{at} names microbatch {action.microbatch} but the step has {microbatches}",
                    schedule,
                    (rank, step),
                )
            home = stage_rank(action.stage, ranks)
            if home != rank:
                raise _fail(
                    f"{at} is on the wrong rank: stage {action.stage} lives on rank {home}",
                    schedule,
                    (rank, step),
                )
            if not action.is_compute:
                _check_peer(action, schedule, (rank, step), ranks=ranks, stages=stages)
            if _key(action) in where:
                first_rank, first_step = where[_key(action)]
                raise _fail(
                    f"{at} is repeated (first at rank {first_rank}, step {first_step})",
                    schedule,
                    (rank, step),
                )
            where[_key(action)] = (rank, step)
    return where


def _check_peer(action: Action, schedule: Schedule, at: _Where, *, ranks: int, stages: int) -> None:
    peer = action.peer_stage
    prefix = f"rank {at[0]}, step {at[1]}: {action}"
    if not 0 <= peer < stages:
        raise _fail(f"{prefix} talks to stage {peer}, which does not exist", schedule, at)
    if stage_rank(peer, ranks) == at[0]:
        raise _fail(
            f"{prefix} talks to stage {peer} on the same rank; remove it, the runtime hands "
            "that tensor over locally",
            schedule,
            at,
        )


def _backward(where: dict[_Key, _Where], stage: int, mb: int) -> tuple[_Key, _Where] | None:
    """The action that produces stage's input gradient for mb: its B, else its I."""
    for kind in (Kind.B, Kind.I):
        if (stage, kind, mb) in where:
            return (stage, kind, mb), where[(stage, kind, mb)]
    return None


def _check_counts(
    schedule: Schedule, where: dict[_Key, _Where], *, stages: int, microbatches: int
) -> None:
    """Every (stage, microbatch) has one F and either one B or one I and one W."""
    for stage in range(stages):
        for mb in range(microbatches):
            name = f"stage {stage}, microbatch {mb}"
            if (stage, Kind.F, mb) not in where:
                raise _fail(f"{name} never runs its forward ({stage}F{mb} is missing)", schedule)
            has = {kind: (stage, kind, mb) in where for kind in (Kind.B, Kind.I, Kind.W)}
            if has[Kind.B] and (has[Kind.I] or has[Kind.W]):
                extra = Kind.I if has[Kind.I] else Kind.W
                raise _fail(
                    f"{name} runs its backward twice: {stage}B{mb} and {stage}{extra.value}{mb}; "
                    "use either one B or one I and one W",
                    schedule,
                    where[(stage, extra, mb)],
                )
            if not any(has.values()):
                raise _fail(
                    f"{name} never runs its backward ({stage}B{mb}, or {stage}I{mb} and "
                    f"{stage}W{mb}, is missing)",
                    schedule,
                )
            if has[Kind.I] != has[Kind.W]:
                present, absent = (Kind.I, Kind.W) if has[Kind.I] else (Kind.W, Kind.I)
                raise _fail(
                    f"{name} has {stage}{present.value}{mb} but no {stage}{absent.value}{mb}; "
                    "a split backward needs both halves",
                    schedule,
                    where[(stage, present, mb)],
                )


def _inputs(action: Action, where: dict[_Key, _Where], *, stages: int) -> list[_Key]:
    """The actions whose results ``action`` consumes (all exist once the counts are checked)."""
    stage, mb = action.stage, action.microbatch
    if action.kind is Kind.F:
        return [(stage - 1, Kind.F, mb)] if stage > 0 else []
    if action.kind in (Kind.B, Kind.I):
        needs = [(stage, Kind.F, mb)]
        later = _backward(where, stage + 1, mb) if stage + 1 < stages else None
        return needs + ([later[0]] if later else [])
    if action.kind is Kind.W:
        return [(stage, Kind.I, mb)]
    if action.kind is Kind.SEND_F:
        return [(stage, Kind.F, mb)]
    if action.kind is Kind.SEND_B:
        found = _backward(where, stage, mb)
        return [found[0]] if found else []
    return []  # a RECV consumes a message, checked by _check_messages


def _check_order(
    schedule: Schedule, where: dict[_Key, _Where], *, ranks: int, stages: int, lowered: bool
) -> None:
    """Dependencies on one rank run in order; in a lowered schedule, every remote input arrives
    through a RECV placed before its consumer, and every send has its receive."""
    for rank in sorted(schedule):
        for step, action in enumerate(schedule[rank]):
            at = f"rank {rank}, step {step}: {action}"
            for needed in _inputs(action, where, stages=stages):
                needed_rank, needed_step = where[needed]
                needed_name = f"{needed[0]}{needed[1].value}{needed[2]}"
                if needed_rank == rank and needed_step > step:
                    raise _fail(
                        f"{at} runs before {needed_name}, which it needs (step {needed_step})",
                        schedule,
                        (rank, step),
                    )
                if needed_rank != rank and lowered:
                    recv_kind = Kind.RECV_F if action.kind is Kind.F else Kind.RECV_B
                    recv = (action.stage, recv_kind, action.microbatch)
                    if recv not in where or where[recv][1] > step:
                        raise _fail(
                            f"{at} needs {needed_name} from rank {needed_rank} but no "
                            f"{action.stage}{recv_kind.value}{action.microbatch} comes before it",
                            schedule,
                            (rank, step),
                        )
            if lowered and not action.is_compute:
                _check_message(action, where, schedule, (rank, step))


def _partner(action: Action) -> _Key:
    """The send that a receive waits for, or the receive that takes a send's message."""
    partner = action.partner  # its stage exists: _check_peer has seen every message
    return (partner.stage, partner.kind, partner.microbatch)


def _check_message(
    action: Action, where: dict[_Key, _Where], schedule: Schedule, at: _Where
) -> None:
    partner = _partner(action)
    if partner in where:
        return
    partner_name = f"{partner[0]}{partner[1].value}{partner[2]}"
    if action.kind in RECEIVE_KINDS:
        problem = f"has no matching SEND ({partner_name} is missing)"
    else:
        problem = f"is never received ({partner_name} is missing)"
    raise _fail(f"rank {at[0]}, step {at[1]}: {action} {problem}", schedule, at)


def _check_deadlock(
    schedule: Schedule, where: dict[_Key, _Where], *, ranks: int, stages: int, lowered: bool
) -> None:
    """Run all ranks in rank order until each finishes or none can move.

    Sends never block. A receive blocks until its send has run. In a compute-only schedule an
    action whose input comes from another rank blocks until that action has run there.
    """
    done: set[_Key] = set()
    cursor = {rank: 0 for rank in schedule}

    def blocker(action: Action) -> _Key | None:
        if action.kind in RECEIVE_KINDS:
            partner = _partner(action)
            return None if partner in done else partner
        if lowered or not action.is_compute:
            return None
        for needed in _inputs(action, where, stages=stages):
            if needed not in done:
                return needed
        return None

    progress = True
    while progress:
        progress = False
        for rank in sorted(schedule):
            actions = schedule[rank]
            while cursor[rank] < len(actions) and blocker(actions[cursor[rank]]) is None:
                done.add(_key(actions[cursor[rank]]))
                cursor[rank] += 1
                progress = True

    stuck = [rank for rank in sorted(schedule) if cursor[rank] < len(schedule[rank])]
    if not stuck:
        return
    waits = []
    for rank in stuck:
        action = schedule[rank][cursor[rank]]
        needed = blocker(action)
        assert needed is not None
        needed_rank = where[needed][0]
        waits.append(
            f"rank {rank} waits at step {cursor[rank]} ({action}) for "
            f"{needed[0]}{needed[1].value}{needed[2]} on rank {needed_rank}"
        )
    raise _fail("deadlock: " + "; ".join(waits), schedule, (stuck[0], cursor[stuck[0]]))
