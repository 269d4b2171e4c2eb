"""Every rank runs ahead through its action list as far as its inputs are known, sweep after
sweep over the ranks, until none moves: when each action starts and ends where every rank has
a device of its own. The kernel under `autopart.schedule.simulate` and the step model's
`autopart.schedule.shared.dedicated_run`.

An action starts when its rank is free and its inputs are there (`input_ready_at`'s rule: a
tensor that changes rank arrives its send's rank time and then its transfer after it was
produced). The end times live in a flat list indexed by (stage, kind, microbatch) rather than a
dict of tuples, and the rule is written out here: a thousand microbatches over a hundred ranks
is a million actions, and the search and the compile run several such pipelines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopart.ir.actions import COMPUTE_KINDS, Action, Kind, Schedule
from autopart.schedule.stage_costs import StageCosts

__all__ = ["EPSILON", "RunAhead", "run_ahead", "woken_s"]

EPSILON = 1e-12
"""Seconds below which two times are the same moment (an idle rank, a receive that waited)."""


@dataclass(frozen=True)
class RunAhead:
    """What `run_ahead` found: every compute action's ``(rank, action, start, end)`` in the
    order they were settled (times not shifted), and per rank where it stopped."""

    events: list[tuple[int, Action, float, float]]
    free: dict[int, float]  # when the rank's last action ended
    idle_since: dict[int, float]  # when its last action of positive length ended
    cursor: dict[int, int]  # how many of its actions ran: all of them unless the schedule deadlocks

    def stuck(self, schedule: Schedule) -> list[int]:
        """The ranks that did not reach the end of their lists, ascending."""
        return [rank for rank in sorted(schedule) if self.cursor[rank] < len(schedule[rank])]


def woken_s(wake_s: Callable[[float], float] | None, idle_since: float, start: float) -> float:
    """What work starting at ``start`` pays for its rank's idle time since ``idle_since``."""
    return max(0.0, wake_s(start - idle_since)) if wake_s and start > idle_since + EPSILON else 0.0


def run_ahead(schedule: Schedule, costs: StageCosts, homes: tuple[int, ...], *,
              wake_s: Callable[[float], float] | None = None, waited_receives: bool = False) -> RunAhead:
    """Run ``schedule`` against ``costs``, each stage on its rank in ``homes``. ``wake_s``: what a
    rank's first work after an idle spell pays (`woken_s`); ``waited_receives``: a receive whose
    data came after its rank was idle takes ``costs.waited_duration``."""
    stages = len(homes)
    last = stages - 1
    microbatches = 1 + max((action.microbatch for actions in schedule.values() for action in actions), default=0)
    # (stage * 3 + slot) * microbatches + microbatch -> the end of that F (slot 0), B (1) or I (2); -1 until it ends
    ended = [-1.0] * (stages * 3 * microbatches)
    slots = {Kind.F: 0, Kind.B: 1, Kind.I: 2}
    crosses = [homes[s] != homes[s + 1] for s in range(stages - 1)]  # per boundary after stage s
    # a gradient message that carries nothing (`StageCosts.gradients`) waits for no backward
    waits_for_gradient = [s < last and (not crosses[s] or costs.gradient_crosses(s)) for s in range(stages)]
    send, transfer = costs.send_s, costs.transfer_s
    durations = None if costs.actions else costs.durations
    duration = costs.duration
    waited = waited_receives and bool(costs.recv_waited_s)  # else a waited receive takes its duration
    F, B, I, W, RECV_F, RECV_B = Kind.F, Kind.B, Kind.I, Kind.W, Kind.RECV_F, Kind.RECV_B
    free_at, idle_at = dict.fromkeys(schedule, 0.0), dict.fromkeys(schedule, 0.0)
    cursor = dict.fromkeys(schedule, 0)
    events: list[tuple[int, Action, float, float]] = []
    progress = True
    while progress:
        progress = False
        for rank, actions in schedule.items():
            at, free, idle = cursor[rank], free_at[rank], idle_at[rank]
            while at < len(actions):
                action = actions[at]
                kind, stage, mb = action.kind, action.stage, action.microbatch
                if kind is F or kind is RECV_F:
                    if stage == 0:
                        ready = 0.0
                    else:
                        ready = ended[(stage - 1) * 3 * microbatches + mb]
                        if ready < 0:
                            break
                        if crosses[stage - 1]:
                            ready = (ready + send[stage - 1] if send else ready) + transfer[stage - 1]
                elif kind is B or kind is I or kind is RECV_B:
                    ready = 0.0 if kind is RECV_B else ended[stage * 3 * microbatches + mb]  # its own forward
                    if ready < 0:
                        break
                    if waits_for_gradient[stage]:
                        base = (stage + 1) * 3 * microbatches + mb
                        gradient = ended[base + microbatches]  # the next stage's B, else its I
                        if gradient < 0:
                            gradient = ended[base + 2 * microbatches]
                            if gradient < 0:
                                break
                        if crosses[stage]:
                            gradient = (gradient + send[stage] if send else gradient) + transfer[stage]
                        if gradient > ready:
                            ready = gradient
                elif kind is W:
                    ready = ended[(stage * 3 + 2) * microbatches + mb]
                    if ready < 0:
                        break
                else:
                    ready = 0.0  # a send: its producer ran earlier on this rank
                start = free if free > ready else ready
                if waited and (kind is RECV_F or kind is RECV_B) and ready > idle + EPSILON:
                    work = costs.waited_duration(action)
                else:
                    work = durations[kind][stage] if durations else duration(action)
                if work > 0:
                    free = idle = start + work + woken_s(wake_s, idle, start) if wake_s else start + work
                else:
                    free = start
                if kind in COMPUTE_KINDS:
                    if kind is not W:
                        ended[(stage * 3 + slots[kind]) * microbatches + mb] = free
                    events.append((rank, action, start, free))
                at += 1
            if at > cursor[rank]:
                cursor[rank], free_at[rank], idle_at[rank], progress = at, free, idle, True
    return RunAhead(events=events, free=free_at, idle_since=idle_at, cursor=cursor)
