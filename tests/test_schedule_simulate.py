"""The simulator reproduces the published bubble and memory figures (REFERENCE.md) with equal
stage times and free transfers, and models transfers, blocking receives and deadlocks."""

import pytest

from autopart.ir.errors import ConfigError, ScheduleError
from autopart.schedule import (
    Action,
    Kind,
    StageCosts,
    add_communication,
    build_schedule,
    simulate,
)


def _parse(rows: dict[int, str]) -> dict[int, list[Action]]:
    return {rank: [Action.parse(t) for t in row.split()] for rank, row in rows.items()}


PM = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (8, 3), (8, 16)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("ranks", "microbatches"), PM)
def test_gpipe_and_1f1b_bubble(kind: str, ranks: int, microbatches: int) -> None:
    # Narayanan et al. SC21 §2.2.1: idle share of the step (p−1)/(m+p−1); step (m+p−1)(t_f+t_b).
    costs = StageCosts.uniform(ranks, forward_s=1.0, backward_s=2.0)
    timeline = simulate(
        build_schedule(kind, ranks=ranks, microbatches=microbatches), costs, ranks=ranks
    )
    assert timeline.bubble == pytest.approx((ranks - 1) / (microbatches + ranks - 1))
    assert timeline.step_s == pytest.approx((microbatches + ranks - 1) * 3.0)


@pytest.mark.parametrize(
    ("ranks", "chunks", "microbatches"),
    [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 3, 4), (8, 4, 16), (3, 2, 6)],
)
@pytest.mark.parametrize(("forward_s", "backward_s"), [(1.0, 1.0), (1.0, 2.0)])
def test_interleaved_bubble(
    ranks: int, chunks: int, microbatches: int, forward_s: float, backward_s: float
) -> None:
    # SC21 §2.2.2: the bubble over the ideal time is (1/v)·(p−1)/m, v chunks of equal cost.
    stages = ranks * chunks
    costs = StageCosts.uniform(stages, forward_s=forward_s, backward_s=backward_s)
    schedule = build_schedule("interleaved", ranks=ranks, microbatches=microbatches, chunks=chunks)
    timeline = simulate(schedule, costs, ranks=ranks)
    ideal = microbatches * chunks * (forward_s + backward_s)
    assert (timeline.step_s - ideal) / ideal == pytest.approx((ranks - 1) / (chunks * microbatches))


@pytest.mark.parametrize(
    ("ranks", "microbatches"), [(2, 2), (3, 4), (4, 4), (4, 9), (8, 8), (8, 16)]
)
@pytest.mark.parametrize(
    ("forward_s", "input_s", "weight_s"), [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 3.0, 1.0)]
)
def test_zb_h1_bubble(
    ranks: int, microbatches: int, forward_s: float, input_s: float, weight_s: float
) -> None:
    # Qi et al. ICLR'24: ZB-H1 idles (p−1)(T_F+T_B−T_W) per rank, T_B the input-gradient half,
    # where 1F1B idles (p−1)(T_F+T_B+T_W). Their setting: m >= p and T_W <= T_F, T_B.
    costs = StageCosts.uniform(
        ranks, forward_s=forward_s, backward_s=input_s + weight_s, weight_s=weight_s
    )
    busy = microbatches * (forward_s + input_s + weight_s)
    zb = simulate(
        build_schedule("zb-h1", ranks=ranks, microbatches=microbatches), costs, ranks=ranks
    )
    assert zb.step_s - busy == pytest.approx((ranks - 1) * (forward_s + input_s - weight_s))
    assert zb.bubble == pytest.approx(1 - busy / zb.step_s)
    one_f_one_b = simulate(
        build_schedule("1f1b", ranks=ranks, microbatches=microbatches), costs, ranks=ranks
    )
    assert one_f_one_b.step_s - busy == pytest.approx(
        (ranks - 1) * (forward_s + input_s + weight_s)
    )


@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 3), (4, 2), (4, 4), (4, 9), (8, 5)])
def test_activations_in_flight(ranks: int, microbatches: int) -> None:
    # SC21 §2.2.1: GPipe keeps all m; 1F1B keeps p−i on stage i (at most m); ZB-H1 stage 0's p on every
    # stage, which holds each microbatch's activations to its W (the peak of 1F1B's first stage, Qi et al.)
    costs = StageCosts.uniform(ranks, forward_s=1.0, backward_s=2.0, weight_s=1.0)
    peaks = {
        kind: simulate(
            build_schedule(kind, ranks=ranks, microbatches=microbatches), costs, ranks=ranks
        ).peak_in_flight
        for kind in ("gpipe", "1f1b", "zb-h1")
    }
    assert peaks["gpipe"] == (microbatches,) * ranks
    assert peaks["1f1b"] == tuple(min(ranks - i, microbatches) for i in range(ranks))
    assert peaks["zb-h1"] == (min(ranks, microbatches),) * ranks


@pytest.mark.parametrize(("ranks", "chunks"), [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_interleaved_first_rank_memory(ranks: int, chunks: int) -> None:
    # Korthikanti et al. MLSys'23 §4.2.3: the first rank keeps (1 + (p−1)/(p·v)) times 1F1B's p
    # microbatches of a whole stage (each chunk holds 1/v of it). Counted at every instant.
    microbatches = 2 * ranks
    costs = StageCosts.uniform(ranks * chunks, forward_s=1.0, backward_s=2.0)
    schedule = build_schedule("interleaved", ranks=ranks, microbatches=microbatches, chunks=chunks)
    live = peak = 0
    for event in simulate(schedule, costs, ranks=ranks).per_rank()[0]:
        live += 1 if event.action.kind is Kind.F else -1
        peak = max(peak, live)
    assert peak / chunks == pytest.approx(ranks * (1 + (ranks - 1) / (ranks * chunks)))


def test_transfers_cost_time_only_across_ranks() -> None:
    costs = StageCosts(
        forward_s=(1.0, 2.0), backward_s=(3.0, 4.0), weight_s=(0.0, 0.0), transfer_s=(0.5,)
    )
    two_ranks = simulate(build_schedule("gpipe", ranks=2, microbatches=1), costs, ranks=2)
    assert [(str(e.action), e.start, e.end) for e in two_ranks.events] == [
        ("0F0", 0.0, 1.0),
        ("1F0", 1.5, 3.5),
        ("1B0", 3.5, 7.5),
        ("0B0", 8.0, 11.0),
    ]
    assert two_ranks.bubble == pytest.approx(1 - 10.0 / (2 * 11.0))
    one_rank = simulate(
        build_schedule("interleaved", ranks=1, microbatches=1, chunks=2), costs, ranks=1
    )
    assert one_rank.step_s == pytest.approx(10.0)
    assert one_rank.bubble == pytest.approx(0.0)


def test_split_backward_durations() -> None:
    costs = StageCosts(forward_s=(1.0,), backward_s=(3.0,), weight_s=(1.0,), transfer_s=())
    timeline = simulate(_parse({0: "0F0 0I0 0W0"}), costs, ranks=1)
    assert [(str(e.action), e.start, e.end) for e in timeline.events] == [
        ("0F0", 0.0, 1.0),
        ("0I0", 1.0, 3.0),
        ("0W0", 3.0, 4.0),
    ]


def test_single_actions_take_their_own_time() -> None:
    costs = StageCosts(forward_s=(1.0,), backward_s=(3.0,), weight_s=(1.0,), transfer_s=(),
                       actions={Action.parse("0I0"): 5.0})
    timeline = simulate(_parse({0: "0F0 0I0 0W0"}), costs, ranks=1)
    assert [(str(e.action), e.start, e.end) for e in timeline.events] == [
        ("0F0", 0.0, 1.0),
        ("0I0", 1.0, 6.0),
        ("0W0", 6.0, 7.0),
    ]


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "interleaved"])
def test_lowered_and_compute_only_schedules_simulate_alike(kind: str) -> None:
    chunks = 2 if kind == "interleaved" else 1
    costs = StageCosts(  # four stages either way: 4 ranks, or 2 ranks with 2 chunks
        forward_s=(1.0, 1.5, 0.5, 1.0),
        backward_s=(2.0, 3.0, 1.0, 2.5),
        weight_s=(1.0, 1.0, 0.5, 1.0),
        transfer_s=(0.1, 0.3, 0.2),
    )
    ranks = 4 // chunks
    schedule = build_schedule(kind, ranks=ranks, microbatches=4, chunks=chunks)
    plain = simulate(schedule, costs, ranks=ranks)
    lowered = simulate(add_communication(schedule, ranks=ranks), costs, ranks=ranks)
    assert plain == lowered
    assert plain.per_rank()[0][0].start == 0.0


def test_blocking_receive_holds_its_rank() -> None:
    # Rank 1 posts both receives first: its 1F0 cannot start before microbatch 1 has arrived.
    schedule = _parse(
        {
            0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            1: "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
        }
    )
    costs = StageCosts.uniform(2, forward_s=1.0, backward_s=1.0, transfer_s=0.25)
    first = simulate(schedule, costs, ranks=2).per_rank()[1][0]
    assert (str(first.action), first.start) == ("1F0", 2.25)


def test_deadlock_raises_with_grid() -> None:
    schedule = _parse({0: "0F0 0B0 0F1 0B1", 1: "1F0 1F1 1B0 1B1"})
    with pytest.raises(
        ScheduleError, match=r"deadlocks: rank 0 at step 1 \(0B0\); rank 1 at step 1 \(1F1\)"
    ) as info:
        simulate(schedule, StageCosts.uniform(2, forward_s=1.0, backward_s=1.0), ranks=2)
    assert "<-- ERROR HERE" in info.value.grid  # type: ignore[attr-defined]


def test_simulate_rejects_misplaced_actions() -> None:
    costs = StageCosts.uniform(2, forward_s=1.0, backward_s=1.0)
    # the first misplaced action of the first rank that has one, by its step
    with pytest.raises(ScheduleError, match=r"^rank 0, step 1: 1F0 is on the wrong rank: stage 1 lives on rank 1$"):
        simulate(_parse({0: "0F0 1F0 0B0 1B0", 1: ""}), costs, ranks=2)
    with pytest.raises(ScheduleError, match=r"^rank 1, step 2: 0B0 is on the wrong rank: stage 0 lives on rank 0$"):
        simulate(_parse({0: "0F0 0B0", 1: "1F0 1B0 0B0 3F0"}), costs, ranks=2)
    with pytest.raises(ScheduleError, match=r"^rank 0, step 2: 2F0 names stage 2 but the costs have 2 stages$"):
        simulate(_parse({0: "0F0 1F0 2F0 1B0 0B0"}), costs, ranks=1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"forward_s": (), "backward_s": (), "weight_s": (), "transfer_s": ()},
            "at least one stage",
        ),
        (
            {
                "forward_s": (1.0, 1.0),
                "backward_s": (1.0,),
                "weight_s": (0.0, 0.0),
                "transfer_s": (0.0,),
            },
            "backward_s has 1 values",
        ),
        (
            {
                "forward_s": (1.0, 1.0),
                "backward_s": (1.0, 1.0),
                "weight_s": (0.0, 0.0),
                "transfer_s": (),
            },
            r"one per boundary \(1\)",
        ),
        (
            {"forward_s": (-1.0,), "backward_s": (1.0,), "weight_s": (0.0,), "transfer_s": ()},
            "negative",
        ),
        (
            {"forward_s": (1.0,), "backward_s": (1.0,), "weight_s": (2.0,), "transfer_s": ()},
            "more than backward_s",
        ),
        (
            {"forward_s": (1.0,), "backward_s": (1.0,), "weight_s": (0.0,), "transfer_s": (),
             "actions": {Action.parse("0F0"): -0.5}},
            "StageCosts.actions has a negative time",
        ),
    ],
)
def test_stage_costs_are_checked(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StageCosts(**fields)


@pytest.mark.parametrize("messages", [False, True])
def test_the_duration_table_is_each_action_s_duration(messages):
    # the simulators read `durations` in place of `duration` wherever no single action has its own time
    stages = 4
    costs = StageCosts(forward_s=(1.0, 1.5, 2.0, 2.5), backward_s=(3.0, 3.1, 3.3, 3.7), weight_s=(0.9, 1.1, 1.3, 0.7),
                       transfer_s=(0.1, 0.2, 0.3), **({"send_s": (0.01, 0.02, 0.03), "recv_s": (0.04, 0.05, 0.06)}
                                                    if messages else {}))
    actions = [Action(stage, kind, 0) for stage in range(stages) for kind in (Kind.F, Kind.B, Kind.I, Kind.W)]
    actions += [Action(stage, kind, 0) for stage in range(stages - 1) for kind in (Kind.SEND_F, Kind.RECV_B)]
    actions += [Action(stage, kind, 0) for stage in range(1, stages) for kind in (Kind.SEND_B, Kind.RECV_F)]
    assert len({(a.kind, a.stage) for a in actions}) == 4 * stages + 4 * (stages - 1)
    for action in actions:
        assert costs.durations[action.kind][action.stage] == costs.duration(action), action


def test_a_boundary_that_no_gradient_crosses_waits_for_no_backward() -> None:
    """Nothing trained before a boundary (a frozen prefix): its gradient messages carry nothing, so
    the stage before it runs its backward once its own forward is done, not after the next
    stage's, and the empty send and receive take no rank time. It waited for a gradient the
    runtime no longer sends."""
    schedule = build_schedule("gpipe", ranks=2, microbatches=1)
    trained = StageCosts.uniform(2, forward_s=1.0, backward_s=2.0)
    frozen = StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(0.0, 0.0), transfer_s=(0.0,),
                        gradients=(False,))
    assert simulate(schedule, trained, ranks=2).step_s == pytest.approx(6.0)  # F, F, B, B one after another
    assert simulate(schedule, frozen, ranks=2).step_s == pytest.approx(4.0)  # the two backwards side by side
    lowered = add_communication(schedule, ranks=2)
    messages = StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(0.0, 0.0), transfer_s=(0.5,),
                          send_s=(0.25,), recv_s=(0.25,), gradients=(False,))
    # rank 1: F after 0.25 + 0.5 of sending and receiving, B; rank 0: F, its send, its empty receive, B
    assert simulate(lowered, messages, ranks=2).step_s == pytest.approx(1.0 + 0.25 + 0.5 + 0.25 + 1.0 + 2.0)
    assert messages.duration(Action.parse("0RECV_B0")) == messages.duration(Action.parse("1SEND_B0")) == 0.0
    with pytest.raises(ConfigError, match="StageCosts.gradients has 2 values for 2 stages"):
        StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0), weight_s=(0.0, 0.0), transfer_s=(0.0,),
                   gradients=(False, True))
