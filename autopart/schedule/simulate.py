"""Predict when every action of a schedule runs, given per-stage costs: a `Timeline`.

The model is the one the schedule formulas in REFERENCE.md assume, and no more: each rank runs
its actions in order, one at a time; an action starts when its rank is free and its inputs have
arrived; a tensor that changes rank arrives ``transfer_s`` after it was produced, one that stays
on its rank arrives at once. Sends take no rank time (they are asynchronous); a receive takes no
rank time either but holds its rank until the data is there, as a blocking ``recv`` does. So a
schedule predicted here and the same schedule measured by the runtime can be compared event by
event, and the plan's bubble and in-flight figures come from the schedule actually emitted.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

from autopart.ir.errors import ScheduleError
from autopart.ir.actions import Action, Kind, Schedule, rank_of
from autopart.schedule.run_ahead import run_ahead
from autopart.schedule.stage_costs import StageCosts
from autopart.schedule.validate import format_grid

__all__ = ["Event", "Timeline", "simulate", "simulated_events", "input_ready_at", "stage_homes"]


class Event(NamedTuple):
    """One compute action as it ran (or is predicted to run) on one rank, in seconds. A named
    tuple, not a frozen dataclass: a plan's timeline can hold a million of them, and a frozen
    dataclass's ``__init__`` (a guarded ``setattr`` per field) took seconds to make them."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """When every compute action runs: predicted by `simulate`, or measured by the runtime."""

    events: tuple[Event, ...]
    step_s: float
    """From the first start to the last end."""
    bubble: float
    """Idle share of the step over all ranks: 1 − busy / (ranks · step_s)."""
    peak_in_flight: tuple[int, ...]
    """Per stage: the most microbatches whose F has run and whose backward (B or I) has not;
    each holds its activations, so this sizes the stage's activation memory."""

    def per_rank(self) -> dict[int, list[Event]]:
        """Each rank's events in start order, ranks ascending."""
        by_rank: dict[int, list[Event]] = {}
        for event in sorted(self.events, key=lambda e: (e.rank, e.start, e.end)):
            by_rank.setdefault(event.rank, []).append(event)
        return by_rank

    @classmethod
    def from_events(cls, events: Iterable[Event], *, ranks: int) -> Timeline:
        """Derive step time, bubble and in-flight peaks from events, e.g. a measured trace.

        Times are shifted so that the first event starts at 0.
        """
        events = list(events)
        if not events:
            return cls(events=(), step_s=0.0, bubble=0.0, peak_in_flight=())
        # the fields read through C (itemgetter, map): a long pipeline's timeline has a million events
        starts = operator.itemgetter(2)
        origin = min(map(starts, events))
        ordered = sorted(events, key=operator.itemgetter(2, 3, 0))  # start, end, rank
        shifted = ordered if origin == 0 else [
            Event(rank=e.rank, action=e.action, start=e.start - origin, end=e.end - origin) for e in ordered
        ]
        ends = operator.itemgetter(3)
        step_s = max(map(ends, shifted))
        busy = sum(map(operator.sub, map(ends, shifted), map(starts, shifted)))
        bubble = 1.0 - busy / (ranks * step_s) if step_s > 0 else 0.0
        return cls(
            events=tuple(shifted),
            step_s=step_s,
            bubble=bubble,
            peak_in_flight=_peak_in_flight(list(map(operator.itemgetter(1), shifted))),
        )


def _peak_in_flight(actions_in_order: list[Action]) -> tuple[int, ...]:
    stages = max(map(operator.attrgetter("stage"), actions_in_order)) + 1
    live = [0] * stages
    peak = [0] * stages
    F, B, W = Kind.F, Kind.B, Kind.W
    for action in actions_in_order:
        kind = action.kind
        if kind is F:
            stage = action.stage
            live[stage] += 1
            if live[stage] > peak[stage]:
                peak[stage] = live[stage]
        elif kind is B or kind is W:  # an I keeps the graph for its W (`autopart.schedule.peaks`)
            live[action.stage] -= 1
    return tuple(peak)


def simulate(schedule: Schedule, costs: StageCosts, *, ranks: int, placement: Sequence[int] | None = None) -> Timeline:
    """Run ``schedule`` against ``costs`` and return when each compute action starts and ends.

    Accepts a compute-only or a lowered schedule. Where messages take no rank time (``costs``
    without ``send_s``, ``recv_s`` or per-action times) both give the same events: lowering puts
    each receive right before the compute it feeds (`add_communication`), so it waits for exactly
    the input that compute would, and each send right after its producer, where it takes no
    time; the compute order alone is the cheaper to run. Raises ScheduleError when an action names a
    stage that ``costs`` does not have or sits on the wrong rank, and on a deadlock (some rank
    waits for an input that is never produced before it). ``placement`` is every stage's rank (a
    V for zbv), the loop of `stage_rank` without it.
    """
    stages = costs.stages
    homes = stage_homes(stages, ranks, placement)
    for rank, actions in schedule.items():
        here = {action.stage for action in actions}  # each stage once: a rank can hold a million actions
        if here and (max(here) >= stages or any(homes[stage] != rank for stage in here)):
            _refuse_placement(rank, actions, stages, homes)
    # Event's fields made in C from run_ahead's tuples (Event(...) per event took seconds)
    events = list(map(tuple.__new__, repeat(Event), _ran(schedule, costs, homes)))
    return Timeline.from_events(events, ranks=ranks)


def _refuse_placement(rank: int, actions: list[Action], stages: int, homes: tuple[int, ...]) -> None:
    """The ScheduleError of the first of ``rank``'s actions that names a stage ``homes`` has not
    or one that lives on another rank."""
    for step, action in enumerate(actions):
        if action.stage >= stages:
            raise ScheduleError(
                f"rank {rank}, step {step}: {action} names stage {action.stage} but the "
                f"costs have {stages} stages"
            )
        if homes[action.stage] != rank:
            raise ScheduleError(f"rank {rank}, step {step}: {action} is on the wrong rank: stage "
                                f"{action.stage} lives on rank {homes[action.stage]}")


def simulated_events(schedule: Schedule, costs: StageCosts, *, ranks: int,
                     placement: Sequence[int] | None = None) -> list[tuple[int, Action, float, float]]:
    """`simulate`'s events as plain ``(rank, action, start, end)`` tuples, in the order they were
    settled, times not shifted: for callers that read a few figures of a long pipeline (the
    search's finalists), for whom a million `Event` objects and their sorting would be most of
    the work. Checks nothing of the schedule that `simulate` checks but deadlocks."""
    return _ran(schedule, costs, stage_homes(costs.stages, ranks, placement))


def _ran(schedule: Schedule, costs: StageCosts, homes: tuple[int, ...]) -> list[tuple[int, Action, float, float]]:
    """`run_ahead`'s events, or the ScheduleError of a deadlock with the grid of where it stuck."""
    run = run_ahead(schedule, costs, homes)
    stuck = run.stuck(schedule)
    if stuck:
        cursor = run.cursor
        waits = "; ".join(f"rank {rank} at step {cursor[rank]} ({schedule[rank][cursor[rank]]})" for rank in stuck)
        error = ScheduleError(f"the schedule deadlocks: {waits} wait for inputs that never arrive")
        error.grid = format_grid(schedule, (stuck[0], cursor[stuck[0]]))  # type: ignore[attr-defined]
        raise error
    return run.events


def stage_homes(stages: int, ranks: int, placement: Sequence[int] | None = None) -> tuple[int, ...]:
    """Each stage's rank (`rank_of`), for `input_ready_at`."""
    return tuple(rank_of(stage, ranks, placement) for stage in range(stages))


def _arrived(sent_at: float, costs: StageCosts, boundary: int) -> float:
    """When a tensor produced at ``sent_at`` is on the other side of ``boundary``: the send's rank
    time, then the transfer, added in that order (one rounding for activations and gradients alike)."""
    return sent_at + (costs.send_s[boundary] if costs.send_s else 0.0) + costs.transfer_s[boundary]


def input_ready_at(action: Action, finished: dict[tuple[int, Kind, int], float], costs: StageCosts,
                   homes: tuple[int, ...]) -> float | None:
    """When the inputs of ``action`` are on its rank, given the end times of the compute actions
    ``finished`` so far ((stage, kind, microbatch) -> end) and each stage's rank (`stage_homes`);
    None while one is not produced. The rule of `autopart.schedule.run_ahead`, which writes it out
    over flat lists (`step_time` asks it where ranks share cores; a test holds the two alike)."""
    stage, mb, kind = action.stage, action.microbatch, action.kind
    if kind is Kind.F or kind is Kind.RECV_F:
        if stage == 0:
            return 0.0
        produced = finished.get((stage - 1, Kind.F, mb))
        if produced is None or homes[stage - 1] == homes[stage]:
            return produced
        return _arrived(produced, costs, stage - 1)
    if kind is Kind.B or kind is Kind.I or kind is Kind.RECV_B:
        own_forward = 0.0 if kind is Kind.RECV_B else finished.get((stage, Kind.F, mb))
        if own_forward is None:
            return None
        crosses = stage < len(homes) - 1 and homes[stage + 1] != homes[stage]
        if stage == len(homes) - 1 or (crosses and not costs.gradient_crosses(stage)):
            return own_forward  # no gradient comes (`StageCosts.gradients`)
        gradient = finished.get((stage + 1, Kind.B, mb))
        if gradient is None:
            gradient = finished.get((stage + 1, Kind.I, mb))
            if gradient is None:
                return None
        if homes[stage + 1] != homes[stage]:
            gradient = _arrived(gradient, costs, stage)
        return max(own_forward, gradient)
    if kind is Kind.W:
        return finished.get((stage, Kind.I, mb))
    return 0.0  # a send: its producer ran earlier on this rank
