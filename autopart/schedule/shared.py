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

from collections.abc import Callable

from autopart.ir.actions import RECEIVE_KINDS, Kind, Schedule
from autopart.schedule.simulate import StageCosts, input_ready_at

__all__ = ["step_time"]

_EPSILON = 1e-12


def step_time(schedule: Schedule, costs: StageCosts, *, ranks: int, cores: int = 0, background: float = 0.0,
              tail_s: dict[int, float] | None = None, resume_s: tuple[float, float] = (0.0, 0.0),
              busy_delay_s: float = 0.0, wake_s: Callable[[float], float] | None = None) -> float:
    """Seconds from the first action to the end of the last rank's tail; ``background`` other
    busy processes share the ``cores`` too; when they and the ranks outnumber the cores, every
    compute action pays ``resume_s`` (forward, backward and its halves) on top of its own time;
    a rank's first work after it sat idle for ``t`` seconds, when it finds a core free (so that
    core sat idle too), pays ``wake_s(t)`` instead if that is more."""
    tail_s = tail_s or {}
    shared = 0 < cores < ranks + background
    idle_since = dict.fromkeys(schedule, 0.0)  # when each rank last finished work
    finished: dict = {}
    cursor = {rank: 0 for rank in schedule}
    remaining: dict[int, float] = {}  # rank -> work left of what it runs now
    running: dict[int, object] = {}  # rank -> the action it runs, or None for its tail
    done: set[int] = set()
    now = 0.0
    while len(done) < len(schedule):
        wakes: list[float] = []
        started = True
        while started:  # start everything that can start now; zero-length actions end at once
            started = False
            for rank, actions in schedule.items():
                if rank in remaining or rank in done:
                    continue
                if cursor[rank] == len(actions):
                    work, action = tail_s.get(rank, 0.0), None
                else:
                    action = actions[cursor[rank]]
                    ready = input_ready_at(action, finished, costs, ranks=ranks)
                    if ready is not None and action.kind in RECEIVE_KINDS and ready > 0 \
                            and 0 < cores <= len(remaining) + background:
                        ready += busy_delay_s
                    if ready is None or ready > now + _EPSILON:
                        if ready is not None:
                            wakes.append(ready)
                        continue
                    waited = action.kind in RECEIVE_KINDS and not shared and ready > idle_since[rank] + _EPSILON
                    work = costs.waited_duration(action) if waited else costs.duration(action)
                    cursor[rank] += 1
                if work > 0:
                    # another rank had this core meanwhile, or it sat idle; the dearer of the two
                    extra = resume_s[action.kind is not Kind.F] if shared and action and action.is_compute else 0.0
                    core_idle = cores <= 0 or len(remaining) + background < cores
                    if wake_s and core_idle and now > idle_since[rank] + _EPSILON:
                        extra = max(extra, wake_s(now - idle_since[rank]))
                    remaining[rank], running[rank] = work + extra, action
                elif action is None:
                    done.add(rank)
                elif action.is_compute:
                    finished[(action.stage, action.kind, action.microbatch)] = now
                started = True
        if not remaining:
            if not wakes:
                break
            now = min(wakes)
            continue
        rate = 1.0 if cores <= 0 else min(1.0, cores / (len(remaining) + background))
        step = min(remaining.values()) / rate
        later = [w for w in wakes if w > now]
        if later:
            step = min(step, min(later) - now)
        now += step
        for rank in list(remaining):
            remaining[rank] -= step * rate
            if remaining[rank] <= _EPSILON:
                action = running.pop(rank)
                del remaining[rank]
                idle_since[rank] = now
                if action is None:
                    done.add(rank)
                elif action.is_compute:
                    finished[(action.stage, action.kind, action.microbatch)] = now
    assert len(done) == len(schedule), "the schedule deadlocks; validate it first"
    return now
