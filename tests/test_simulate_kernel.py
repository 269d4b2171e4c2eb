"""The flat kernel (`autopart.schedule.run_ahead`) under `simulate`, `simulated_events` and the
step model's `dedicated_run` times every action as the dict-keyed readiness of `input_ready_at`
does, bit for bit, on generated and lowered schedules with random costs, messages that take rank
time, waited receives, a wake-up price and single actions' own times; and the search's summary
of a run (`autopart.solve.simulated`) reads the figures a `Timeline` has."""

import random

import pytest

from autopart.ir.actions import COMPUTE_KINDS, RECEIVE_KINDS
from autopart.schedule import (Kind, StageCosts, add_communication, build_schedule, simulate, simulated_events,
                               stage_placement)
from autopart.schedule.shared import dedicated_run
from autopart.schedule.simulate import input_ready_at, stage_homes
from autopart.solve import simulated


def _reference(schedule, costs, ranks, placement, wake_s=None, waited=False):
    """Each action when its rank is free and `input_ready_at` says its inputs are there, one
    sweep over the ranks after another: the simulators as they were before the kernel. Events
    in start order; per rank, when it was free and since when idle."""
    homes = stage_homes(costs.stages, ranks, placement)
    finished, cursor, events = {}, dict.fromkeys(schedule, 0), []
    free, idle = dict.fromkeys(schedule, 0.0), dict.fromkeys(schedule, 0.0)
    progress = True
    while progress:
        progress = False
        for rank in sorted(schedule):
            while cursor[rank] < len(schedule[rank]):
                action = schedule[rank][cursor[rank]]
                ready = input_ready_at(action, finished, costs, homes)
                if ready is None:
                    break
                start = max(free[rank], ready)
                if waited and action.kind in RECEIVE_KINDS and ready > idle[rank] + 1e-12:
                    work = costs.waited_duration(action)
                else:
                    work = costs.duration(action)
                free[rank] = start
                if work > 0:
                    woken = max(0.0, wake_s(start - idle[rank])) if wake_s and start > idle[rank] + 1e-12 else 0.0
                    free[rank] = idle[rank] = start + work + woken
                if action.kind in COMPUTE_KINDS:
                    finished[(action.stage, action.kind, action.microbatch)] = free[rank]
                    events.append((rank, str(action), start, free[rank]))
                cursor[rank] += 1
                progress = True
    return sorted(events, key=lambda e: (e[2], e[3], e[0])), free, idle


def _costs(rng: random.Random, stages: int, messages: bool, schedule) -> StageCosts:
    def times(n: int, low: float = 0.0) -> tuple[float, ...]:
        return tuple(rng.choice([0.0, rng.uniform(low, 3.0)]) if low == 0 else rng.uniform(low, 3.0) for _ in range(n))

    backward = times(stages, 0.5)
    actions = [a for actions in schedule.values() for a in actions]
    return StageCosts(
        forward_s=times(stages, 0.1), backward_s=backward,
        weight_s=tuple(b * rng.choice([0.0, rng.random()]) for b in backward),
        transfer_s=times(stages - 1),
        **({"send_s": times(stages - 1), "recv_s": times(stages - 1), "recv_waited_s": times(stages - 1)}
           if messages else {}),
        actions={a: rng.uniform(0.0, 2.0) for a in rng.sample(actions, 3)} if rng.random() < 0.3 else {},
        # some boundaries behind which nothing trains: their gradient messages carry nothing
        gradients=tuple(rng.random() < 0.6 for _ in range(stages - 1)) if rng.random() < 0.5 else (),
    )


@pytest.mark.parametrize("seed", range(24))
def test_the_kernel_times_every_action_as_input_ready_at_does(seed: int) -> None:
    rng = random.Random(seed)
    kind = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"])
    ranks = rng.choice([1, 2, 3, 4]) if kind not in ("interleaved", "zbv") else rng.choice([2, 4])
    chunks = {"interleaved": rng.choice([2, 3]), "zbv": 2}.get(kind, 1)
    microbatches = rng.choice([1, 2, 3, 5, 8]) if kind != "interleaved" else ranks * rng.choice([1, 2])
    if kind == "zbv":
        microbatches = max(microbatches, 2 * ranks)
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    schedule = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    messages = rng.random() < 0.5
    if messages or rng.random() < 0.5:
        schedule = add_communication(schedule, ranks=ranks, placement=placement)
    costs = _costs(rng, ranks * chunks, messages, schedule)
    if rng.random() < 0.5:  # the ranks in another order: the times do not depend on the order they are run in
        schedule = dict(reversed(list(schedule.items())))

    def in_start_order(events):
        return sorted(((r, str(a), s, e) for r, a, s, e in events), key=lambda e: (e[2], e[3], e[0]))

    expected, _, _ = _reference(schedule, costs, ranks, placement)
    raw = simulated_events(schedule, costs, ranks=ranks, placement=placement)
    assert in_start_order(raw) == expected
    timeline = simulate(schedule, costs, ranks=ranks, placement=placement)
    assert [(e.rank, str(e.action), e.start, e.end) for e in timeline.events] == expected  # starts at 0 here

    # the step model's: waited receives take their own time, and work after an idle spell pays to wake
    wake = rng.choice([None, lambda idle: 0.01 + 0.1 * idle, lambda idle: -0.5])
    expected, free, idle = _reference(schedule, costs, ranks, placement, wake_s=wake, waited=True)
    events = []
    run = dedicated_run(schedule, costs, ranks=ranks, wake_s=wake, events=events, placement=placement)
    assert (in_start_order(events), run.free, run.idle_since) == (expected, free, idle)


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize(("kind", "pp", "microbatches", "chunks"),
                         [("1f1b", 4, 8, 1), ("zb-h1", 3, 5, 1), ("interleaved", 2, 4, 3), ("zbv", 2, 4, 2)])
def test_the_search_reads_a_run_as_its_timeline_has_it(kind, pp, microbatches, chunks, uniform) -> None:
    # uniform: equal stages, weight gradients of no time (a W ends as it starts, with others at once)
    rng = random.Random(7)
    stages = pp * chunks
    if uniform:
        costs = StageCosts.uniform(stages, forward_s=1.0, backward_s=2.0, weight_s=0.0)
    else:
        backward = tuple(rng.uniform(1.0, 3.0) for _ in range(stages))
        costs = StageCosts(forward_s=tuple(rng.uniform(0.5, 1.5) for _ in range(stages)), backward_s=backward,
                           weight_s=tuple(b / 3 for b in backward),
                           transfer_s=tuple(rng.uniform(0, 0.2) for _ in range(stages - 1)))
    schedule = build_schedule(kind, ranks=pp, microbatches=microbatches, chunks=chunks)
    timeline = simulate(schedule, costs, ranks=pp, placement=stage_placement(kind, ranks=pp, chunks=chunks))
    ends = [max(e.end for e in timeline.events if e.rank == rank) for rank in range(pp)]
    final = {}  # the rule the search read before: the last in start order of those ending last
    for e in timeline.events:
        if e.action.kind in (Kind.B, Kind.W) and e.end >= final.get(e.action.stage, (0.0, -1.0))[1]:
            final[e.action.stage] = (e.start, e.end)
    run = simulated._run(kind, pp, microbatches, chunks, costs)
    assert (run.step_s, run.ends, run.final) == (timeline.step_s, tuple(ends), final)
