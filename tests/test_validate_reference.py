"""validate() decides as a plain reading of its rules would, on schedules broken at random.

The validator takes shortcuts for schedules of millions of actions (the kinds' counts where they
settle it, a rank moved only when what blocked it has run, a lowered schedule's messages compared
as keys): each is checked here against a reference written as the rules read, on generated
schedules with one action moved, lowered or not. The reference's deadlock check sweeps the ranks
in rounds, every input counted, until none moves; the ranks it leaves stuck, and where, must be
those the validator names.
"""

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopart.ir.errors import ScheduleError
from autopart.schedule import Action, Kind, add_communication, build_schedule, check_message_order, validate

_RECEIVE = {Kind.RECV_F: Kind.SEND_F, Kind.RECV_B: Kind.SEND_B}


def _inputs(action: Action, present: set, stages: int) -> list[tuple]:
    """What the action consumes, by the rules: a forward the previous stage's forward, a backward
    its own forward and the next stage's backward (whole or its input half), a W its I."""
    s, kind, mb = action.stage, action.kind, action.microbatch
    if kind is Kind.F:
        return [(s - 1, Kind.F, mb)] if s > 0 else []
    if kind in (Kind.B, Kind.I):
        later = [(s + 1, k, mb) for k in (Kind.B, Kind.I) if s + 1 < stages and (s + 1, k, mb) in present]
        return [(s, Kind.F, mb), *later[:1]]
    if kind is Kind.W:
        return [(s, Kind.I, mb)]
    return []


def _reference_stuck(schedule: dict[int, list[Action]], stages: int) -> list[tuple[int, int]]:
    """(rank, step) of every rank the round-by-round sweep leaves stuck."""
    present = {(a.stage, a.kind, a.microbatch) for actions in schedule.values() for a in actions}
    lowered = any(a.kind not in (Kind.F, Kind.B, Kind.I, Kind.W) for actions in schedule.values() for a in actions)
    done: set = set()
    cursor = dict.fromkeys(schedule, 0)

    def ready(action: Action) -> bool:
        if action.kind in _RECEIVE:
            step = -1 if action.kind is Kind.RECV_F else 1
            return (action.stage + step, _RECEIVE[action.kind], action.microbatch) in done
        return lowered or all(needed in done for needed in _inputs(action, present, stages))

    moved = True
    while moved:
        moved = False
        for rank in sorted(schedule):
            actions = schedule[rank]
            while cursor[rank] < len(actions) and ready(actions[cursor[rank]]):
                action = actions[cursor[rank]]
                done.add((action.stage, action.kind, action.microbatch))
                cursor[rank] += 1
                moved = True
    return [(rank, cursor[rank]) for rank in sorted(schedule) if cursor[rank] < len(schedule[rank])]


_SHAPES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(_SHAPES), ranks=st.integers(2, 4), extra=st.integers(0, 3), lowered=st.booleans(),
       data=st.data())
def test_validate_agrees_with_the_rules_read_plainly(shape, ranks, extra, lowered, data):
    kind, chunks = shape
    microbatches = ranks * (1 + extra % 2) if kind == "interleaved" else ranks + extra  # a multiple of its ranks
    stages = ranks * chunks
    schedule = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    if lowered:
        schedule = add_communication(schedule, ranks=ranks)
    rank = data.draw(st.integers(0, ranks - 1), label="rank")
    actions = list(schedule[rank])
    moved = actions.pop(data.draw(st.integers(0, len(actions) - 1), label="from"))
    actions.insert(data.draw(st.integers(0, len(actions)), label="to"), moved)
    schedule = {**schedule, rank: actions}

    stuck = _reference_stuck(schedule, stages)
    try:
        validate(schedule, ranks=ranks, stages=stages, microbatches=microbatches)
    except ScheduleError as error:
        message = str(error)
        if message.startswith("deadlock: "):
            named = [(int(r), int(s)) for r, s in re.findall(r"rank (\d+) waits at step (\d+)", message)]
            assert named == stuck
        else:  # refused before the deadlock check: an action before what it needs on its rank,
            assert "runs before" in message or "comes before it" in message or "out of order" in message, message
        return
    assert stuck == [], f"validate accepted a schedule that stops at {stuck}"
    if lowered:
        check_message_order(schedule, ranks=ranks)


def test_backwards_whole_for_some_microbatches_and_split_for_others_are_valid():
    # the kinds' counts settle neither way here (4 B, 2 I, 2 W over 2 stages x 3 microbatches):
    # each (stage, microbatch) is checked on its own
    schedule = {
        0: [Action.parse(a) for a in "0F0 0F1 0F2 0B0 0I1 0W1 0B2".split()],
        1: [Action.parse(a) for a in "1F0 1B0 1F1 1I1 1F2 1B2 1W1".split()],
    }
    validate(schedule, ranks=2, stages=2, microbatches=3)
    broken = {**schedule, 1: [a for a in schedule[1] if str(a) != "1W1"] + [Action.parse("1B1")]}
    try:
        validate(broken, ranks=2, stages=2, microbatches=3)
    except ScheduleError as error:
        assert "runs its backward twice: 1B1 and 1I1" in str(error)
    else:
        raise AssertionError("a B beside an I of the same microbatch was accepted")
