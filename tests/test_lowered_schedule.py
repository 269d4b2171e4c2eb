"""A pipeline's lowered schedule is built once per shape, simulating the shared schedule gives
what a schedule built afresh gives, and where messages take no rank time the compute order alone
times as its lowering does."""

from __future__ import annotations

import random

import pytest

from autopart.ir.errors import ScheduleError
from autopart.predict.timeline import simulate_pipeline
from autopart.schedule import StageCosts, add_communication, build_schedule, built_lowered, simulate, stage_placement


@pytest.mark.parametrize(("kind", "ranks", "microbatches", "chunks"),
                         [("1f1b", 3, 5, 1), ("zb-h1", 4, 8, 1), ("interleaved", 2, 4, 2), ("gpipe", 2, 3, 1)])
def test_the_shared_schedule_simulates_as_a_fresh_one(kind, ranks, microbatches, chunks) -> None:
    stages = ranks * chunks
    costs = dict(forward_s=tuple(1.0 + 0.1 * s for s in range(stages)),
                 backward_s=tuple(2.0 + 0.3 * s for s in range(stages)),
                 weight_s=(0.5,) * stages, transfer_s=(0.05,) * (stages - 1))
    fresh = simulate(add_communication(build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks),
                                       ranks=ranks), StageCosts(**costs), ranks=ranks)
    first = simulate_pipeline(kind=kind, ranks=ranks, microbatches=microbatches, chunks=chunks, **costs)
    again = simulate_pipeline(kind=kind, ranks=ranks, microbatches=microbatches, chunks=chunks, **costs)
    assert first.events == fresh.events and again.events == fresh.events
    assert built_lowered(kind, ranks, microbatches, chunks) is built_lowered(kind, ranks, microbatches, chunks)


def test_costs_for_stages_the_schedule_lacks_are_refused() -> None:
    with pytest.raises(ScheduleError):
        simulate_pipeline(kind="1f1b", ranks=2, microbatches=2, chunks=1, forward_s=(1.0,) * 3, backward_s=(2.0,) * 3,
                          weight_s=(1.0,) * 3, transfer_s=(0.0,) * 2)


@pytest.mark.parametrize("seed", range(40))
def test_the_compute_order_times_as_its_lowering_where_messages_take_no_rank_time(seed) -> None:
    # simulate_pipeline, plan_timeline and the search's finalists run the compute order alone:
    # lowering puts each receive right before its consumer and each send right after its producer
    rng = random.Random(seed)
    kind = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"])
    ranks = rng.randint(1, 5)
    chunks = {"interleaved": rng.randint(2, 3), "zbv": 2}.get(kind, 1)
    microbatches = {"interleaved": ranks * rng.randint(1, 3), "zbv": rng.randint(2 * ranks - 1, 4 * ranks)}.get(
        kind, rng.randint(1, 3 * ranks))
    stages = ranks * chunks
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    compute = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    backward = tuple(rng.uniform(0.5, 3.0) for _ in range(stages))
    costs = StageCosts(forward_s=tuple(rng.uniform(0.2, 2.0) for _ in range(stages)), backward_s=backward,
                       weight_s=tuple(b * rng.uniform(0.1, 0.6) for b in backward),
                       transfer_s=tuple(rng.choice([0.0, rng.uniform(0.0, 1.5)]) for _ in range(stages - 1)))
    alone = simulate(compute, costs, ranks=ranks, placement=placement)
    lowered = simulate(add_communication(compute, ranks=ranks, placement=placement), costs, ranks=ranks,
                       placement=placement)
    assert alone.events == lowered.events
    assert (alone.step_s, alone.bubble, alone.peak_in_flight) == (lowered.step_s, lowered.bubble,
                                                                  lowered.peak_in_flight)


def test_lowering_reports_the_first_bad_action_as_it_meets_it():
    """Asked per stage once, the lowering still fails on the first action that is wrong, with
    its own error, and never sizes anything by the largest stage number it meets."""
    from autopart.ir.actions import Action, Kind
    from autopart.ir.errors import ScheduleError
    from autopart.schedule.lowering import add_communication

    already = {0: [Action(0, Kind.SEND_F, 0)], 1: [Action(3, Kind.F, 0)]}
    with pytest.raises(ScheduleError, match="already a communication action"):
        add_communication(already, ranks=2, placement=(0, 1))
    with pytest.raises(ScheduleError, match="belongs on rank 0"):
        add_communication({1: [Action(10**9, Kind.F, 0)]}, ranks=2)
