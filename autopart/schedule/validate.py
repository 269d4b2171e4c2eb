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

import collections
from collections.abc import Sequence

from autopart.ir.errors import ScheduleError
from autopart.ir.actions import COMPUTE_KINDS, PARTNER_KIND, RECEIVE_KINDS, Action, Kind, Schedule, rank_of

__all__ = ["validate", "format_grid", "check_message_order"]

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


def validate(
    schedule: Schedule, *, ranks: int, stages: int, microbatches: int, placement: Sequence[int] | None = None
) -> None:
    """Raise ScheduleError unless ``schedule`` runs every forward and backward once, in an
    order that respects the data dependencies, without a deadlock.

    The schedule may be compute-only or lowered by `add_communication`; it counts as lowered
    as soon as it holds one send or receive, and then every tensor that changes rank must go
    through a matching SEND/RECV pair, received in the order it was sent (the runtime's messages
    between two ranks carry no tag). ``placement`` is the rank of every stage (a V for zbv); the
    loop of `stage_rank` without it.
    """
    where = _place_actions(schedule, ranks=ranks, stages=stages, microbatches=microbatches, placement=placement)
    _check_counts(schedule, where, stages=stages, microbatches=microbatches)
    lowered = any(not a.is_compute for actions in schedule.values() for a in actions)
    _check_order(schedule, where, ranks=ranks, stages=stages, lowered=lowered)
    _check_deadlock(schedule, where, ranks=ranks, stages=stages, lowered=lowered)
    if lowered:
        check_message_order(schedule, ranks=ranks, placement=placement)


def _fail(message: str, schedule: Schedule, mark: _Where | None = None) -> ScheduleError:
    error = ScheduleError(message)
    error.grid = format_grid(schedule, mark)  # type: ignore[attr-defined]
    error.at = mark  # type: ignore[attr-defined]  # (rank, step), for a caller that numbers steps otherwise
    return error


def _key(action: Action) -> _Key:
    return (action.stage, action.kind, action.microbatch)


def _place_actions(
    schedule: Schedule, *, ranks: int, stages: int, microbatches: int, placement: Sequence[int] | None
) -> dict[_Key, _Where]:
    """Where each action runs; fails on a foreign rank, index out of range or a repeat."""
    where: dict[_Key, _Where] = {}
    for rank in sorted(schedule):
        if not 0 <= rank < ranks:
            raise _fail(
                f"the schedule has rank {rank} but the pipeline has {ranks} ranks", schedule
            )
        for step, action in enumerate(schedule[rank]):
            if not isinstance(action, Action):
                raise _fail(f"rank {rank}, step {step}: {action} is not an Action", schedule, (rank, step))
            if action.stage >= stages or action.microbatch >= microbatches or \
                    rank_of(action.stage, ranks, placement) != rank:
                _misplaced(action, schedule, (rank, step), ranks=ranks, stages=stages,
                           microbatches=microbatches, placement=placement)
            if action.kind not in COMPUTE_KINDS:
                _check_peer(action, schedule, (rank, step), ranks=ranks, stages=stages, placement=placement)
            key = (action.stage, action.kind, action.microbatch)
            if key in where:
                first_rank, first_step = where[key]
                raise _fail(f"rank {rank}, step {step}: {action} is repeated (first at rank {first_rank}, "
                            f"step {first_step})", schedule, (rank, step))
            where[key] = (rank, step)
    return where


def _misplaced(action: Action, schedule: Schedule, at: _Where, *, ranks: int, stages: int, microbatches: int,
               placement: Sequence[int] | None) -> None:
    """Raise the error of an action that `_place_actions` found out of range or on another rank
    (worded here, not for every action: a schedule holds up to millions)."""
    prefix = f"rank {at[0]}, step {at[1]}: {action}"
    if action.stage >= stages:
        raise _fail(f"{prefix} names stage {action.stage} but the pipeline has {stages} stages", schedule, at)
    if action.microbatch >= microbatches:
        raise _fail(f"{prefix} names microbatch {action.microbatch} but the step has {microbatches}", schedule, at)
    home = rank_of(action.stage, ranks, placement)
    raise _fail(f"{prefix} is on the wrong rank: stage {action.stage} lives on rank {home}", schedule, at)


def _check_peer(
    action: Action, schedule: Schedule, at: _Where, *, ranks: int, stages: int, placement: Sequence[int] | None
) -> None:
    peer = action.peer_stage
    if 0 <= peer < stages and rank_of(peer, ranks, placement) != at[0]:
        return
    prefix = f"rank {at[0]}, step {at[1]}: {action}"
    if not 0 <= peer < stages:
        raise _fail(f"{prefix} talks to stage {peer}, which does not exist", schedule, at)
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
    # `_place_actions` kept each action once and in range: where every (stage, microbatch) has a
    # forward and the backwards are all whole or all split, the counts of the kinds say so (a
    # schedule holds up to millions); any other mix is checked one by one, for its message
    counts = collections.Counter(kind for _, kind, _ in where)
    whole, split = counts[Kind.B], counts[Kind.I]
    if counts[Kind.F] == stages * microbatches and counts[Kind.W] == split and \
            (whole, split) in ((stages * microbatches, 0), (0, stages * microbatches)):
        return
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
            for needed in _inputs(action, where, stages=stages):
                needed_rank, needed_step = where[needed]
                if needed_rank == rank and needed_step > step:
                    raise _fail(
                        f"rank {rank}, step {step}: {action} runs before {_name(needed)}, which it needs "
                        f"(step {needed_step})",
                        schedule,
                        (rank, step),
                    )
                if needed_rank != rank and lowered:
                    recv_kind = Kind.RECV_F if action.kind is Kind.F else Kind.RECV_B
                    recv = (action.stage, recv_kind, action.microbatch)
                    if recv not in where or where[recv][1] > step:
                        raise _fail(
                            f"rank {rank}, step {step}: {action} needs {_name(needed)} from rank {needed_rank} "
                            f"but no {_name(recv)} comes before it",
                            schedule,
                            (rank, step),
                        )
            if lowered and action.kind not in COMPUTE_KINDS:
                _check_message(action, where, schedule, (rank, step))


def _name(key: _Key) -> str:
    return f"{key[0]}{key[1].value}{key[2]}"


def _partner(action: Action) -> _Key:
    """The send that a receive waits for, or the receive that takes a send's message (as
    ``action.partner``, without making the Action: its stage exists, _check_peer has seen every message)."""
    return (action.peer_stage, PARTNER_KIND[action.kind], action.microbatch)


def _check_message(
    action: Action, where: dict[_Key, _Where], schedule: Schedule, at: _Where
) -> None:
    partner = _partner(action)
    if partner in where:
        return
    partner_name = _name(partner)
    if action.kind in RECEIVE_KINDS:
        problem = f"has no matching SEND ({partner_name} is missing)"
    else:
        problem = f"is never received ({partner_name} is missing)"
    raise _fail(f"rank {at[0]}, step {at[1]}: {action} {problem}", schedule, at)


def _check_deadlock(
    schedule: Schedule, where: dict[_Key, _Where], *, ranks: int, stages: int, lowered: bool
) -> None:
    """Run every rank until each finishes or none can move.

    Sends never block (on NCCL, a send waits on a stream of its own direction for a receive
    that its channel's order puts next: ``check_message_order``). A receive blocks until its send
    has run. In a compute-only schedule an action whose input comes from another rank blocks
    until that action has run there.

    A rank runs until it blocks, then waits on what blocked it and moves again once that has run:
    each action is visited about once, where sweeping the ranks round after round until none moves
    visits every blocked rank each round (a pipeline's backward wave moves one rank per round). A
    rank's progress depends only on what has run, so the ranks stop where they would in any order:
    the same ranks stuck, at the same steps.
    """
    done: set[_Key] = set()
    cursor = {rank: 0 for rank in schedule}

    def blocker(action: Action) -> _Key | None:  # `_inputs` not yet run, less what its own order settles
        kind = action.kind
        if kind in RECEIVE_KINDS:
            partner = _partner(action)
            return None if partner in done else partner
        if lowered or kind is Kind.W or kind not in COMPUTE_KINDS:
            return None  # (a W's input, its I, runs on its rank: `_check_order` saw it before)
        stage, mb = action.stage, action.microbatch
        if kind is Kind.F:
            needed = (stage - 1, kind, mb)
            return needed if stage > 0 and needed not in done else None
        # a B or an I: its forward runs on its rank before it (`_check_order`); the next stage's backward
        if stage + 1 == stages:
            return None
        later = _backward(where, stage + 1, mb)
        return later[0] if later is not None and later[0] not in done else None

    waiting: dict[_Key, list[int]] = {}  # an action not run yet -> the ranks blocked on it
    movable = sorted(schedule, reverse=True)
    while movable:
        rank = movable.pop()
        actions, at = schedule[rank], cursor[rank]
        while at < len(actions):
            needed = blocker(actions[at])
            if needed is not None:
                waiting.setdefault(needed, []).append(rank)
                break
            key = _key(actions[at])
            done.add(key)
            movable.extend(waiting.pop(key, ()))
            at += 1
        cursor[rank] = at

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


def check_message_order(schedule: Schedule, *, ranks: int, placement: Sequence[int] | None = None) -> None:
    """Raise ScheduleError unless, between two ranks and in each direction, the receiver takes
    the messages in the order the sender sends them.

    The runtime posts a pipeline's activations and its gradients each on a process group per
    direction (``autopart.runtime.p2p.Channels``), and on each a receive takes whatever message
    comes next: one out of order would fill its buffers with another microbatch's tensors (or
    hang on a shape that differs). In order, a direction's messages also never wait behind the
    other direction's on NCCL, which holds a pair's stream at a send until its receive is posted.
    """
    homes: dict[int, int] = {}  # stage -> its rank (a lowered schedule holds millions of messages)

    def home(stage: int) -> int:
        found = homes.get(stage)
        if found is None:
            found = homes[stage] = rank_of(stage, ranks, placement)
        return found

    # per channel (sender, receiver, activations or not), the (stage, microbatch) of each send in
    # order; each message's peer is `Action.peer_stage` written out (the property, asked millions
    # of times, was a fifth of this check)
    sent: dict[tuple[int, int, bool], list[tuple[int, int]]] = {}
    for rank in sorted(schedule):
        for action in schedule[rank]:
            kind = action.kind
            if kind is Kind.SEND_F or kind is Kind.SEND_B:
                forward = kind is Kind.SEND_F
                channel = (rank, home(action.stage + 1 if forward else action.stage - 1), forward)
                sent.setdefault(channel, []).append((action.stage, action.microbatch))
    taken: dict[tuple[int, int, bool], int] = {}
    for rank in sorted(schedule):
        for step, action in enumerate(schedule[rank]):
            kind = action.kind
            if kind is not Kind.RECV_F and kind is not Kind.RECV_B:
                continue
            forward = kind is Kind.RECV_F
            peer = action.stage - 1 if forward else action.stage + 1  # the sending stage
            channel = (home(peer), rank, forward)
            position = taken.get(channel, 0)
            taken[channel] = position + 1
            sends = sent.get(channel, ())
            if position < len(sends) and sends[position] == (peer, action.microbatch):
                continue
            expected = None if position >= len(sends) else Action(sends[position][0], PARTNER_KIND[kind],
                                                                    sends[position][1])
            what = "activation" if forward else "gradient"
            raise _fail(
                f"rank {rank}, step {step}: {action} receives out of order: {what} message {position} from "
                f"rank {channel[0]} is {expected or 'never sent'}; exchange the messages in the same order on both ranks",
                schedule,
                (rank, step),
            )
