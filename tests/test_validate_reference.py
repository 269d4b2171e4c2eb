"""validate() decides as a plain reading of its rules would, on schedules broken at random.

The validator takes shortcuts for schedules of millions of actions (the kinds' counts where they
settle it, a rank moved only when what blocked it has run and asked only what its own order does
not already settle, a lowered schedule's messages compared as keys): each is checked here against
a reference written as the rules read, on generated schedules (a V-shape's placement among them)
with an action moved, dropped, repeated or of another kind, lowered or not. validate must refuse
exactly what the reference refuses; where it names a deadlock, the ranks the reference's sweep
(the ranks in rounds, every input counted, until none moves) leaves stuck, at those steps.
"""

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopart.ir.errors import ScheduleError
from autopart.schedule import Action, Kind, add_communication, build_schedule, stage_placement, validate

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W
COMPUTE = (F, B, I, W)
PARTNER = {Kind.SEND_F: Kind.RECV_F, Kind.RECV_F: Kind.SEND_F, Kind.SEND_B: Kind.RECV_B, Kind.RECV_B: Kind.SEND_B}
FORWARD_MESSAGES = (Kind.SEND_F, Kind.RECV_F)


def _key(action: Action) -> tuple:
    return action.stage, action.kind, action.microbatch


def _peer(action: Action) -> int:
    return action.stage + (1 if action.kind in (Kind.SEND_F, Kind.RECV_B) else -1)


def _inputs(action: Action, where: dict, stages: int) -> list[tuple]:
    """What an action consumes: a forward the previous stage's forward, a backward (or its input
    half) its own forward and the next stage's backward, a W its I, a send what it sends."""
    s, kind, mb = action.stage, action.kind, action.microbatch
    backward = lambda stage: next(((stage, k, mb) for k in (B, I) if (stage, k, mb) in where), None)  # noqa: E731
    if kind is F:
        return [(s - 1, F, mb)] if s > 0 else []
    if kind in (B, I):
        later = backward(s + 1) if s + 1 < stages else None
        return [(s, F, mb)] + ([later] if later else [])
    if kind is W:
        return [(s, I, mb)]
    if kind is Kind.SEND_F:
        return [(s, F, mb)]
    if kind is Kind.SEND_B:
        found = backward(s)
        return [found] if found else []
    return []


def _reference(schedule: dict, *, stages: int, microbatches: int, placement: tuple[int, ...]) -> tuple[bool, list]:
    """(whether every rule holds, the (rank, step) of each rank the round-by-round sweep leaves stuck)."""
    where: dict = {}
    for rank, actions in schedule.items():
        for step, action in enumerate(actions):
            if _key(action) in where:
                return False, []  # an action twice
            where[_key(action)] = (rank, step)
    for s in range(stages):
        for mb in range(microbatches):
            kinds = {k for k in COMPUTE if (s, k, mb) in where}
            if kinds not in ({F, B}, {F, I, W}):
                return False, []  # a forward or a backward missing, or a backward twice
    lowered = any(a.kind not in COMPUTE for actions in schedule.values() for a in actions)
    valid = True
    for rank, actions in schedule.items():
        for step, action in enumerate(actions):
            if action.kind not in COMPUTE and (_peer(action), PARTNER[action.kind], action.microbatch) not in where:
                valid = False  # a message with no other end
            for needed in _inputs(action, where, stages):
                needed_rank, needed_step = where[needed]
                if needed_rank == rank and needed_step > step:
                    valid = False  # before what it needs, on its own rank
                elif needed_rank != rank and lowered:
                    receiving = Kind.RECV_F if action.kind is F else Kind.RECV_B
                    receive = where.get((action.stage, receiving, action.microbatch))
                    valid &= receive is not None and receive[1] < step  # received before it is used
    if lowered:  # on each channel (sender, receiver, direction), received in the order sent
        channels: dict = {}
        for rank in sorted(schedule):
            for action in schedule[rank]:
                if action.kind not in COMPUTE:
                    sending = action.kind in (Kind.SEND_F, Kind.SEND_B)
                    ends = (rank, placement[_peer(action)]) if sending else (placement[_peer(action)], rank)
                    stage = action.stage if sending else _peer(action)
                    channel = channels.setdefault((*ends, action.kind in FORWARD_MESSAGES), ([], []))
                    channel[0 if sending else 1].append((stage, action.microbatch))
        valid &= all(sent == received for sent, received in channels.values())

    done: set = set()
    cursor = dict.fromkeys(schedule, 0)

    def ready(action: Action) -> bool:
        if action.kind in (Kind.RECV_F, Kind.RECV_B):
            return (_peer(action), PARTNER[action.kind], action.microbatch) in done
        return lowered or all(needed in done for needed in _inputs(action, where, stages))

    moved = True
    while moved:
        moved = False
        for rank in sorted(schedule):
            actions = schedule[rank]
            while cursor[rank] < len(actions) and ready(actions[cursor[rank]]):
                done.add(_key(actions[cursor[rank]]))
                cursor[rank] += 1
                moved = True
    stuck = [(rank, cursor[rank]) for rank in sorted(schedule) if cursor[rank] < len(schedule[rank])]
    return valid and not stuck, stuck


_SHAPES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zbv", 2)]
_BREAKS = ["move", "drop", "repeat", "rekind"]


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(_SHAPES), ranks=st.integers(2, 4), extra=st.integers(0, 3), lowered=st.booleans(),
       breaks=st.lists(st.sampled_from(_BREAKS), min_size=1, max_size=2), data=st.data())
def test_validate_refuses_what_the_rules_refuse(shape, ranks, extra, lowered, breaks, data):
    kind, chunks = shape
    if kind == "interleaved":
        microbatches = ranks * (1 + extra % 2)  # a multiple of its ranks
    elif kind == "zbv":
        microbatches = 2 * ranks - 1 + extra
    else:
        microbatches = ranks + extra
    stages = ranks * chunks
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    schedule = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    if lowered:
        schedule = add_communication(schedule, ranks=ranks, placement=placement)
    for broken in breaks:
        rank = data.draw(st.integers(0, ranks - 1), label="rank")
        actions = list(schedule[rank])
        at = data.draw(st.integers(0, len(actions) - 1), label="at")
        if broken == "move":
            actions.insert(data.draw(st.integers(0, len(actions) - 1), label="to"), actions.pop(at))
        elif broken == "drop":
            actions.pop(at)
        elif broken == "repeat":
            actions.insert(data.draw(st.integers(0, len(actions)), label="to"), actions[at])
        elif actions[at].kind in COMPUTE:  # another compute kind in its place
            other = data.draw(st.sampled_from([k for k in COMPUTE if k is not actions[at].kind]), label="kind")
            actions[at] = Action(actions[at].stage, other, actions[at].microbatch)
        schedule = {**schedule, rank: actions}

    valid, stuck = _reference(schedule, stages=stages, microbatches=microbatches, placement=placement)
    try:
        validate(schedule, ranks=ranks, stages=stages, microbatches=microbatches, placement=placement)
    except ScheduleError as error:
        assert not valid, f"validate refused what every rule allows: {error}"
        message = str(error)
        if message.startswith("deadlock: "):
            assert [(int(r), int(s)) for r, s in re.findall(r"rank (\d+) waits at step (\d+)", message)] == stuck
        return
    assert valid, f"validate accepted a schedule the rules refuse (stuck: {stuck})"


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
