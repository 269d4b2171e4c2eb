"""A pipeline's lowered schedule is built once per shape, simulating the shared schedule gives
what a schedule built afresh gives, and where messages take no rank time the compute order alone
times as its lowering does: in the simulator, and in the step model of ranks with a device each."""

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


def _random_pipeline(rng: random.Random) -> tuple[str, int, int, int, StageCosts]:
    kind = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"])
    ranks = rng.randint(1, 5)
    chunks = {"interleaved": rng.randint(2, 3), "zbv": 2}.get(kind, 1)
    microbatches = {"interleaved": ranks * rng.randint(1, 3), "zbv": rng.randint(2 * ranks - 1, 4 * ranks)}.get(
        kind, rng.randint(1, 3 * ranks))
    stages = ranks * chunks
    backward = tuple(rng.uniform(0.5, 3.0) for _ in range(stages))
    costs = StageCosts(forward_s=tuple(rng.uniform(0.2, 2.0) for _ in range(stages)), backward_s=backward,
                       weight_s=tuple(b * rng.uniform(0.1, 0.6) for b in backward),
                       transfer_s=tuple(rng.choice([0.0, rng.uniform(0.0, 1.5)]) for _ in range(stages - 1)))
    return kind, ranks, microbatches, chunks, costs


@pytest.mark.parametrize("seed", range(40))
def test_the_compute_order_times_as_its_lowering_where_messages_take_no_rank_time(seed) -> None:
    # simulate_pipeline, plan_timeline and the search's finalists run the compute order alone:
    # lowering puts each receive right before its consumer and each send right after its producer
    kind, ranks, microbatches, chunks, costs = _random_pipeline(random.Random(seed))
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    compute = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
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


@pytest.mark.parametrize("seed", range(30))
def test_the_step_model_times_the_compute_order_as_its_lowering_on_devices_of_their_own(seed) -> None:
    # predicted_step_s runs a named GPU's pipeline on the compute order alone (timed_schedule): its
    # data-parallel reductions, their triggers, each rank's wake-up and tail as on the lowering
    from autopart.ir.buckets import final_gradient_positions
    from autopart.predict.reduction import Reduction, overlapped_step_time
    from autopart.schedule import built

    rng = random.Random(seed)
    kind, ranks, microbatches, chunks, costs = _random_pipeline(rng)
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    compute, lowered = built(kind, ranks, microbatches, chunks)[0], built_lowered(kind, ranks, microbatches, chunks)
    reductions = {}
    for rank, actions in lowered.items():
        final = final_gradient_positions(actions)
        reductions[rank] = [Reduction(trigger=actions[position], fraction=rng.choice([1.0, rng.random()]),
                                      seconds=rng.uniform(0.0, 3.0)) for position in sorted(final.values())]
    tails = {rank: rng.uniform(0.0, 1.0) for rank in range(ranks)}

    def step(schedule):
        return overlapped_step_time(schedule, costs, reductions, ranks=ranks, cores=0, tail_s=tails, slowdown=0.25,
                                    placement=placement, wake_s=lambda idle: 0.01 * idle)

    assert step(compute) == step(lowered)


def test_the_step_model_lowers_the_schedule_only_where_its_messages_take_time() -> None:
    from autopart.predict.step_time import timed_schedule
    from autopart.schedule import built

    shape = ("1f1b", 3, 6, 1)
    free = StageCosts.uniform(3, forward_s=1.0, backward_s=2.0, transfer_s=0.5)
    compute, lowered = built(*shape)[0], built_lowered(*shape)
    assert timed_schedule(*shape, free, cores=0, replayed=False) is compute
    assert timed_schedule(*shape, free, cores=2, replayed=False) is lowered  # ranks that share cores
    assert timed_schedule(*shape, free, cores=0, replayed=True) is lowered  # a measured step, action by action
    for timed in ({"send_s": (0.1, 0.0)}, {"recv_s": (0.0, 0.1)}, {"recv_s": (0.0, 0.0), "recv_waited_s": (0.1, 0.0)},
                  {"actions": {compute[1][0]: 1.5}}):
        costs = StageCosts(forward_s=free.forward_s, backward_s=free.backward_s, weight_s=free.weight_s,
                           transfer_s=free.transfer_s, **timed)
        assert costs.messages_take_rank_time and timed_schedule(*shape, costs, cores=0, replayed=False) is lowered
    assert not free.messages_take_rank_time
