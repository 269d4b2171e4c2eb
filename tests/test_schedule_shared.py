"""Step time when ranks share cores: processor sharing over the same action lists."""

import random

import pytest

from autopart.ir.errors import ConfigError, ScheduleError
from autopart.schedule import (SCHEDULE_KINDS, SPLIT_BACKWARD_KINDS, StageCosts, add_communication, build_schedule,
                               simulate, stage_placement)
from autopart.schedule.shared import step_time
from cost_models import load_device


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_processor_sharing_bounds(kind: str, ranks: int) -> None:
    schedule = add_communication(build_schedule(kind, ranks=ranks, microbatches=8, chunks=1), ranks=ranks)
    costs = StageCosts(forward_s=(1.0,) * ranks, backward_s=(2.0,) * ranks, weight_s=(0.5,) * ranks,
                       transfer_s=(0.1,) * (ranks - 1))
    alone = simulate(schedule, costs, ranks=ranks).step_s
    # a core per rank: the simulator's step, then the tail of the last rank to finish
    assert step_time(schedule, costs, ranks=ranks) == pytest.approx(alone)
    assert step_time(schedule, costs, ranks=ranks, tail_s={ranks - 1: 0.0, 0: 0.25}) == pytest.approx(alone + 0.25)
    # one core: every second of work runs one after another
    work = 8 * 3.0 * ranks
    assert work - 1e-9 <= step_time(schedule, costs, ranks=ranks, cores=1) <= work + 1.0
    shared = step_time(schedule, costs, ranks=ranks, cores=2)
    if ranks <= 2:
        assert shared == pytest.approx(alone)
    else:
        assert max(alone, work / 2) <= shared + 1e-9 and shared < work


@pytest.mark.parametrize("kind", sorted(SCHEDULE_KINDS))
def test_a_device_per_rank_runs_as_the_event_loop_with_more_cores_than_ranks(kind: str) -> None:
    """``cores=0`` runs each rank's list ahead (linear in the actions); with more cores than work
    the event loop applies the same rules: the same step, and every action at the same time."""
    rng = random.Random(kind)
    for ranks, microbatches in ((1, 3), (2, 5), (4, 8)):
        chunks = 2 if kind in ("interleaved", "zbv") else 1
        if kind == "interleaved" and microbatches % ranks:
            continue
        placement = stage_placement(kind, ranks=ranks, chunks=chunks)
        schedule = add_communication(build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks),
                                     ranks=ranks, placement=placement)
        stages, edges = len(placement), len(placement) - 1
        forward = tuple(rng.uniform(0.5, 2.0) for _ in range(stages))
        costs = StageCosts(forward_s=forward, backward_s=tuple(2 * f for f in forward),
                           weight_s=tuple(0.8 * f for f in forward), transfer_s=tuple(rng.uniform(0, 0.3) for _ in range(edges)),
                           send_s=(0.02,) * edges, recv_s=(0.04,) * edges, recv_waited_s=(0.01,) * edges)  # fmt: skip
        tails = {rank: rng.uniform(0.0, 1.0) for rank in range(ranks)}
        timed: list[list] = [[], []]
        steps = [step_time(schedule, costs, ranks=ranks, cores=cores, tail_s=tails, placement=placement,
                           wake_s=lambda idle: 0.05 * min(idle, 1.0), events=events)
                 for cores, events in ((0, timed[0]), (10**6, timed[1]))]  # fmt: skip
        assert steps[0] == pytest.approx(steps[1], rel=1e-12)
        dedicated, event_loop = (sorted(events, key=lambda e: (e[0], str(e[1]))) for events in timed)
        assert [e[:2] for e in dedicated] == [e[:2] for e in event_loop] and len(dedicated) == 2 * stages * microbatches \
            + (stages * microbatches if kind in SPLIT_BACKWARD_KINDS else 0)
        for a, b in zip(dedicated, event_loop):
            assert a[2:] == pytest.approx(b[2:], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("cores", [0, 1, 4])
def test_a_schedule_that_cannot_finish_is_an_error_not_a_time(cores: int) -> None:
    # the step model runs built schedules unvalidated: a deadlock must not come out as a step
    schedule = build_schedule("1f1b", ranks=2, microbatches=2)
    schedule[1] = [schedule[1][1], schedule[1][0], *schedule[1][2:]]  # 1B0 before 1F0
    costs = StageCosts.uniform(2, forward_s=1.0, backward_s=2.0)
    with pytest.raises(ScheduleError, match=r"the schedule deadlocks: ranks 0, 1 wait|the schedule deadlocks: ranks 1 wait"):
        step_time(schedule, costs, ranks=2, cores=cores)


def test_the_gradient_s_arrival_adds_the_send_then_the_transfer() -> None:
    # the same rounding as the forward's arrival, (end + send) + transfer: a plan's figures do not
    # move in their last digit between versions
    schedule = build_schedule("gpipe", ranks=2, microbatches=1)
    costs = StageCosts(forward_s=(0.0, 0.0), backward_s=(0.0, 0.15), weight_s=(0.0, 0.0), transfer_s=(0.3,),
                       send_s=(0.2,))
    activation_there = (0.0 + 0.2) + 0.3
    gradient_there = ((activation_there + 0.15) + 0.2) + 0.3  # 1.1500000000000001, not 1.15
    assert simulate(schedule, costs, ranks=2).step_s == gradient_there


def test_measured_comm_curves_interpolate_and_extend(tmp_path) -> None:
    spec = load_device("h100-sxm")
    import dataclasses

    measured = dataclasses.replace(spec, comm_curves={"p2p": [[4, 1e-4], [1000, 2e-4], [2000, 4e-4]]}, comm_ranks=2)
    assert measured.measured_comm_time("p2p", 1) == 1e-4
    assert measured.measured_comm_time("p2p", 1500) == pytest.approx(3e-4)
    assert measured.measured_comm_time("p2p", 3000) == pytest.approx(6e-4)
    assert measured.measured_comm_time("all_reduce", 10) is None


def test_sends_and_receives_take_rank_time_and_delay_the_data() -> None:
    # one microbatch over two ranks, by hand: F0 on rank 0 ends at 1, its send at 1.1, the data
    # is on rank 1 at 1.6, its receive ends at 1.8; F and B on rank 1 to 4.8, the gradient's
    # send to 4.9, on rank 0 at 5.4, received at 5.6, B on rank 0 to 7.6
    schedule = add_communication(build_schedule("gpipe", ranks=2, microbatches=1, chunks=1), ranks=2)
    plain = StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(0.0, 0.0), transfer_s=(0.5,))
    messages = StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(0.0, 0.0), transfer_s=(0.5,),
                          send_s=(0.1,), recv_s=(0.2,))
    assert simulate(schedule, plain, ranks=2).step_s == pytest.approx(7.0)
    assert simulate(schedule, messages, ranks=2).step_s == pytest.approx(7.6)
    assert step_time(schedule, messages, ranks=2) == pytest.approx(7.6)
    with pytest.raises(ConfigError, match=r"send_s has 2 values for 2 stages"):
        StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(0.0, 0.0), transfer_s=(0.5,), send_s=(0.1, 0.1))


def test_a_receive_that_waited_takes_its_waited_time_and_one_whose_data_came_first_its_own() -> None:
    # gpipe, two microbatches over two ranks, every message 0.1 to send and 0.5 on the way;
    # a receive takes 0.2 when its data came first, 0.05 once it is there when it waited
    schedule = add_communication(build_schedule("gpipe", ranks=2, microbatches=2, chunks=1), ranks=2)
    assert [str(a) for a in schedule[1]][:4] == ["1RECV_F0", "1F0", "1RECV_F1", "1F1"]

    def step(rank1_forward_s: float, waited: tuple[float, ...]) -> float:
        costs = StageCosts(forward_s=(1.0, rank1_forward_s), backward_s=(2.0, 2.0), weight_s=(0.0, 0.0),
                           transfer_s=(0.5,), send_s=(0.1,), recv_s=(0.2,), recv_waited_s=waited)
        return step_time(schedule, costs, ranks=2)

    # every receive waits: 1RECV_F0 (data at 1.6) ends 1.65, 1F0 2.65, 1RECV_F1 (data at 2.7)
    # 2.75, 1F1 3.75, 1B0 5.75 + send, 1B1 7.85 + send; 0RECV_B0 (data at 6.35) 6.4, 0B0 8.4,
    # 0RECV_B1 (data at 8.45) 8.5, 0B1 10.5; with 0.2 for each instead, 11.0
    assert step(1.0, (0.05,)) == pytest.approx(10.5)
    assert step(1.0, ()) == pytest.approx(11.0)
    # rank 1's forward 2.0: it reaches 1RECV_F1 at 3.65, after its data (2.7): 0.2 there
    # (3.85), then 1F1 5.85, 1B0 7.85, 1B1 9.95 + sends; 0RECV_B0 (data at 8.45) 8.5, 0B0 10.5,
    # 0RECV_B1 (data at 10.55) 10.6, 0B1 12.6
    assert step(2.0, (0.05,)) == pytest.approx(12.6)
    # two ranks on one core: the woken rank waits for the core too, the receive's own time stands
    shared = [step_time(schedule, StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(0.0, 0.0),
                                             transfer_s=(0.5,), send_s=(0.1,), recv_s=(0.2,), recv_waited_s=waited),
                        ranks=2, cores=1) for waited in ((0.05,), ())]
    assert shared[0] == shared[1]
    with pytest.raises(ConfigError, match="recv_waited_s needs recv_s"):
        StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(0.0, 0.0), transfer_s=(0.5,),
                   recv_waited_s=(0.05,))


def test_ranks_sharing_cores_pay_the_resume_cost_on_every_compute_action() -> None:
    schedule = add_communication(build_schedule("1f1b", ranks=2, microbatches=8, chunks=1), ranks=2)
    costs = StageCosts.uniform(2, forward_s=1.0, backward_s=2.0)
    resume = (0.1, 0.25)
    # one core: every second of work, resumes included, runs one after another
    base = step_time(schedule, costs, ranks=2, cores=1)
    assert step_time(schedule, costs, ranks=2, cores=1, resume_s=resume) == pytest.approx(base + 2 * 8 * 0.35)
    # a core per rank, nothing else running: no rank ever takes another's core
    assert step_time(schedule, costs, ranks=2, cores=2, resume_s=resume) == step_time(schedule, costs, ranks=2, cores=2)
    # ... unless other processes busy the cores too
    assert step_time(schedule, costs, ranks=2, cores=2, background=1.0, resume_s=resume) > \
        step_time(schedule, costs, ranks=2, cores=2, background=1.0)


def test_message_rank_time_comes_from_the_measured_curves() -> None:
    import dataclasses

    from cost_models.roofline import RooflineCostModel

    spec = load_device("h100-sxm")
    assert RooflineCostModel(device=spec).p2p_rank_time(1e6) == (0.0, 0.0)
    assert RooflineCostModel(device=spec).p2p_busy_delay() == 0.0
    measured = dataclasses.replace(spec, comm_curves={"p2p_send_cpu": [[4, 1e-4], [1000, 3e-4]],
                                                      "p2p_recv_cpu": [[4, 2e-4], [1000, 2e-4]],
                                                      "p2p_busy_delay": [[1, 1e-3]]}, comm_ranks=2)
    model = RooflineCostModel(device=measured)
    assert model.p2p_busy_delay() == 1e-3
    assert model.p2p_rank_time(502) == pytest.approx((2e-4, 2e-4))
    assert model.p2p_rank_time(502, across_nodes=True) == (0.0, 0.0)


def test_a_message_that_finds_every_core_busy_is_received_later() -> None:
    schedule = add_communication(build_schedule("1f1b", ranks=4, microbatches=8, chunks=1), ranks=4)
    costs = StageCosts.uniform(4, forward_s=1.0, backward_s=2.0, transfer_s=0.1)
    # with a core for every rank a receiver always has one: the delay never applies
    assert step_time(schedule, costs, ranks=4, cores=4, busy_delay_s=0.5) == step_time(schedule, costs, ranks=4, cores=4)
    # four ranks on two cores: messages often arrive while two others compute
    shared = step_time(schedule, costs, ranks=4, cores=2)
    delayed = step_time(schedule, costs, ranks=4, cores=2, busy_delay_s=0.5)
    assert shared < delayed <= shared + 0.5 * 2 * 8 * 3  # at most every message of the step, one after another


def test_a_rank_that_waited_pays_the_wake_cost_on_its_next_work() -> None:
    # one microbatch over two ranks, by hand, with wake(t) = t / 10: F0 on rank 0 ends at 1, the
    # data is on rank 1 at 1.5 after 1.5 s idle, so its F runs 1.5 + 1 + 0.15 and its B (no idle)
    # 2 more, to 4.65; the gradient reaches rank 0 at 5.15, after 4.15 s idle: B0 to 5.15 + 2 + 0.415
    schedule = add_communication(build_schedule("gpipe", ranks=2, microbatches=1, chunks=1), ranks=2)
    costs = StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(0.0, 0.0), transfer_s=(0.5,))
    assert step_time(schedule, costs, ranks=2) == pytest.approx(7.0)
    assert step_time(schedule, costs, ranks=2, wake_s=lambda idle: idle / 10) == pytest.approx(7.565)
    # on one core the same: while the data travels no rank computes, so the core sits idle ...
    assert step_time(schedule, costs, ranks=2, cores=1, wake_s=lambda idle: idle / 10) == pytest.approx(7.565)
    # ... unless another process keeps it busy: then a rank finds no core free and pays the resume cost instead
    busy = step_time(schedule, costs, ranks=2, cores=1, background=1.0, resume_s=(0.01, 0.01))
    assert step_time(schedule, costs, ranks=2, cores=1, background=1.0, resume_s=(0.01, 0.01),
                     wake_s=lambda idle: idle / 10) == pytest.approx(busy)
    # a rank that never waits never pays it, its tail included
    alone = add_communication(build_schedule("1f1b", ranks=1, microbatches=4, chunks=1), ranks=1)
    one = StageCosts.uniform(1, forward_s=1.0, backward_s=2.0)
    assert step_time(alone, one, ranks=1, tail_s={0: 0.5}, wake_s=lambda idle: 1.0) == pytest.approx(12.5)


def test_the_wake_cost_comes_from_the_measured_curve() -> None:
    import dataclasses

    from cost_models.roofline import RooflineCostModel

    spec = load_device("h100-sxm")
    assert RooflineCostModel(device=spec).wake_time(0.01) == 0.0  # not measured: nothing
    measured = dataclasses.replace(spec, comm_curves={"wake": [[0.002, 5e-4], [0.01, 1e-3]]}, comm_ranks=2)
    model = RooflineCostModel(device=measured)
    assert model.wake_time(0.0) == 0.0
    assert model.wake_time(0.001) == pytest.approx(2.5e-4)  # from nothing at no idleness
    assert model.wake_time(0.006) == pytest.approx(7.5e-4)
    assert model.wake_time(1.0) == pytest.approx(1e-3)  # flat past the last point


def test_compute_inside_a_pipeline_takes_the_measured_factor_longer(monkeypatch, tmp_path) -> None:
    import dataclasses
    from pathlib import Path

    import autopart
    from cost_models.roofline import RooflineCostModel

    spec = load_device("h100-sxm")
    assert RooflineCostModel(device=spec).pipeline_compute_factor() == 1.0  # not measured: a GPU's own units
    measured = dataclasses.replace(spec, comm_curves={"pipeline_compute": [[1, 1.07]]}, comm_ranks=2)
    assert RooflineCostModel(device=measured).pipeline_compute_factor() == pytest.approx(1.07)
    noise = dataclasses.replace(spec, comm_curves={"pipeline_compute": [[1, 0.97]]}, comm_ranks=2)
    assert RooflineCostModel(device=noise).pipeline_compute_factor() == 1.0  # never faster than alone

    gpt = Path(__file__).resolve().parent.parent / "examples" / "gpt.py"
    options = dict(micro_batch_size=2, microbatches=4, schedule="gpipe", device="h100-sxm", time_limit_s=5)
    pinned = autopart.emit(autopart.compile(gpt, pp=2, **options), tmp_path / "out") / "plan.json"
    single = autopart.compile(gpt, pp=1, **options)
    base = autopart.compile(gpt, pp=2, plan=pinned, **options)
    monkeypatch.setattr(RooflineCostModel, "pipeline_compute_factor", lambda self: 2.0)
    slower = autopart.compile(gpt, pp=2, plan=pinned, **options)
    # the same cuts; every forward and backward twice as long, the rest (messages, optimizer) as it was
    compute = sum(s.forward_s + s.backward_s for s in base.stages)
    assert base.predicted.step_s < slower.predicted.step_s < 2 * base.predicted.step_s
    assert slower.predicted.step_s - base.predicted.step_s > compute  # every microbatch's compute grew
    assert autopart.compile(gpt, pp=1, **options).predicted.step_s == pytest.approx(single.predicted.step_s)  # no pipeline
