"""The step time of a schedule when ranks share a few cores, with each rank's work after it.

`simulate` gives every rank a device of its own. On a CPU machine the ranks are processes that
share its cores: when more ranks compute at once than there are cores, each advances at
``cores / busy`` of its own speed (processor sharing, what the kernel's scheduler gives
CPU-bound processes), and other processes running on the machine take their share as well. Sharing has a price besides the
share: a rank whose core another rank had just before starts each compute action with cold
caches, and pays ``resume_s`` (forward, backward) more for it (measured by ``autopart profile``);
and a message that arrives while every core is busy is received ``busy_delay_s`` later, when
its rank gets a core again (measured by ``autopart profile-comm``). A receive that waited for
its data takes ``recv_waited_s`` once it is there, not ``recv_s``, where each rank keeps a core;
where they outnumber the cores the woken rank must get one back first, which ``recv_s`` holds
better (``benchmarks/cost_accuracy.py`` compares the two). When they do not outnumber
the cores, or when they do but fewer are busy for a while (a pipeline's fill and drain), a rank
that waited leaves its core idle, and its next work runs slower while the core warms up again:
``wake_s``, extra seconds by idle time (measured by ``autopart profile-comm``).
``step_time`` runs the same action lists under that rule, and after each
rank's last action its ``tail_s`` (the optimizer step and anything else the step does after the
pipeline), and returns when the last rank is done. With ``cores = 0`` (a device per rank) it
equals `simulate`'s step plus the longest tail on the last rank to finish.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from autopart.ir.errors import ScheduleError
from autopart.ir.actions import RECEIVE_KINDS, Action, Kind, Schedule
from autopart.schedule.run_ahead import EPSILON, run_ahead, woken_s
from autopart.schedule.simulate import input_ready_at, stage_homes
from autopart.schedule.stage_costs import StageCosts

__all__ = ["DedicatedRun", "dedicated_run", "step_time"]

def step_time(schedule: Schedule, costs: StageCosts, *, ranks: int, cores: int = 0, background: float = 0.0,
              tail_s: dict[int, float] | None = None, resume_s: tuple[float, float] = (0.0, 0.0),
              busy_delay_s: float = 0.0, wake_s: Callable[[float], float] | None = None,
              events: list[tuple[int, Action, float, float]] | None = None,
              placement: Sequence[int] | None = None) -> float:
    """Seconds from the first action to the end of the last rank's tail; ``background`` other
    busy processes share the ``cores`` too; when they and the ranks outnumber the cores, every
    compute action pays ``resume_s`` (forward, backward and its halves) on top of its own time;
    a rank's first work after it sat idle for ``t`` seconds, when it finds a core free (so that
    core sat idle too), pays ``wake_s(t)`` instead if that is more. ``events`` gets every compute
    action as (rank, action, start, end); ``placement``: every stage's rank, as `simulate`."""
    tail_s, events = tail_s or {}, [] if events is None else events
    if cores <= 0:
        run = dedicated_run(schedule, costs, ranks=ranks, wake_s=wake_s, events=events, placement=placement)
        return run.step(tail_s)
    shared = cores < ranks + background  # from here on cores > 0: `dedicated_run` took the rest
    idle_since = dict.fromkeys(schedule, 0.0)  # when each rank last finished work
    finished: dict = {}
    cursor = {rank: 0 for rank in schedule}
    remaining: dict[int, float] = {}  # rank -> work left of what it runs now
    running: dict[int, object] = {}  # rank -> the action it runs, or None for its tail
    began: dict[int, float] = {}  # rank -> when what it runs now started
    done, now = set[int](), 0.0
    # only the ranks that run nothing are looked at when things may start (the others cannot)
    order, idle = {rank: position for position, rank in enumerate(schedule)}, set(schedule)
    inputs = _InputTimes(finished, costs, ranks=ranks, placement=placement)
    while len(done) < len(schedule):
        wakes, started = [], True
        while started:  # start everything that can start now; zero-length actions end at once
            started = False
            for rank in sorted(idle, key=order.__getitem__):
                actions = schedule[rank]
                if cursor[rank] == len(actions):
                    work, action = tail_s.get(rank, 0.0), None
                else:
                    action = actions[cursor[rank]]
                    ready = inputs.ready_at(rank, cursor[rank], action)
                    if ready is not None and action.kind in RECEIVE_KINDS and ready > 0 \
                            and cores <= len(remaining) + background:
                        ready += busy_delay_s
                    if ready is None or ready > now + EPSILON:
                        if ready is not None:
                            wakes.append(ready)
                        continue
                    waited = action.kind in RECEIVE_KINDS and not shared and ready > idle_since[rank] + EPSILON
                    work = costs.waited_duration(action) if waited else costs.duration(action)
                    cursor[rank] += 1
                if work > 0:
                    # another rank had this core meanwhile, or it sat idle; the dearer of the two
                    extra = resume_s[action.kind is not Kind.F] if shared and action and action.is_compute else 0.0
                    core_idle = len(remaining) + background < cores
                    if wake_s and core_idle and now > idle_since[rank] + EPSILON:
                        extra = max(extra, wake_s(now - idle_since[rank]))
                    remaining[rank], running[rank], began[rank] = work + extra, action, now
                    idle.discard(rank)
                elif action is None:
                    done.add(rank)
                    idle.discard(rank)
                elif action.is_compute:
                    finished[(action.stage, action.kind, action.microbatch)] = now
                    events.append((rank, action, now, now))
                started = True
        if not remaining:
            if not wakes:
                break
            now = min(wakes)
            continue
        rate = min(1.0, cores / (len(remaining) + background))
        step = min([min(remaining.values()) / rate] + [w - now for w in wakes if w > now])
        now += step
        for rank in _progressed(remaining, step * rate):
            action = running.pop(rank)
            idle_since[rank] = now
            (done if action is None else idle).add(rank)
            if action is not None and action.is_compute:
                finished[(action.stage, action.kind, action.microbatch)] = now
                events.append((rank, action, began[rank], now))
    if len(done) != len(schedule):
        raise _deadlock(schedule, sorted(set(schedule) - done))
    return now


def _progressed(remaining: dict[int, float], work: float) -> list[int]:
    """Take ``work`` off what every running rank has left; the ranks done, no longer in ``remaining``."""
    ended = []
    for rank in list(remaining):
        remaining[rank] -= work
        if remaining[rank] <= EPSILON:
            del remaining[rank]
            ended.append(rank)
    return ended


class _InputTimes:
    """`input_ready_at` of each rank's next action, asked again only when it can have changed:
    a known time is fixed (finished entries are never rewritten), and an unknown one can become
    known only when some action finishes. At a thousand microbatches over a hundred ranks,
    asking every waiting rank at every event was most of a compile's time."""

    def __init__(self, finished: dict, costs: StageCosts, *, ranks: int, placement: Sequence[int] | None) -> None:
        self.finished, self.costs, self.homes = finished, costs, stage_homes(costs.stages, ranks, placement)
        self.asked: dict[int, tuple[int, int, float | None]] = {}  # rank -> (its cursor, len(finished), time)

    def ready_at(self, rank: int, cursor: int, action: Action) -> float | None:
        known = self.asked.get(rank)
        if known is not None and known[0] == cursor and (known[2] is not None or known[1] == len(self.finished)):
            return known[2]
        ready = input_ready_at(action, self.finished, self.costs, self.homes)
        self.asked[rank] = (cursor, len(self.finished), ready)
        return ready


def _deadlock(schedule: Schedule, stuck: list[int]) -> ScheduleError:
    """The step model runs schedules that were built, not validated (`autopart.schedule.built`): a
    schedule that cannot finish is an error here, never a time."""
    return ScheduleError(f"the schedule deadlocks: ranks {', '.join(map(str, stuck))} wait for inputs that never "
                         "arrive; validate it (autopart.schedule.validate) to see where")


@dataclass(frozen=True)
class DedicatedRun:
    """Where each rank stands after its last action when every rank has a device of its own
    (`dedicated_run`): its tail comes after all of its actions and changes nothing of anyone's
    pipeline, so steps with other tails (the data-parallel reductions' waits,
    `autopart.predict.reduction`) need no second run."""

    free: dict[int, float]  # per rank, when its last action ended
    idle_since: dict[int, float]  # per rank, when its last action of positive length ended
    wake_s: Callable[[float], float] | None

    def step(self, tail_s: Mapping[int, float]) -> float:
        """The step: each rank's ``tail_s`` after its last action (waking first if it sat idle)."""
        tails = (tail_s.get(rank, 0.0) for rank in self.free)
        return max((self.free[rank] + (tail + woken_s(self.wake_s, self.idle_since[rank], self.free[rank])
                                       if tail > 0 else 0.0)
                    for rank, tail in zip(self.free, tails)), default=0.0)


def dedicated_run(schedule: Schedule, costs: StageCosts, *, ranks: int, wake_s: Callable[[float], float] | None,
                  events: list[tuple[int, Action, float, float]], placement: Sequence[int] | None) -> DedicatedRun:
    """`step_time`'s pipeline where every rank has a device of its own: nothing is shared, so a
    rank's action starts when the rank is free and the action's inputs are there, and each rank's
    list can run ahead as far as its inputs are known (as `simulate` does) instead of event by
    event over every rank: the same times (to rounding) in time about linear in the actions, which
    a thousand microbatches over a hundred ranks need."""
    run = run_ahead(schedule, costs, stage_homes(costs.stages, ranks, placement), wake_s=wake_s, waited_receives=True)
    stuck = run.stuck(schedule)
    if stuck:
        raise _deadlock(schedule, stuck)
    events.extend(run.events)
    return DedicatedRun(free=run.free, idle_since=run.idle_since, wake_s=wake_s)
