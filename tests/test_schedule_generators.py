"""The generators emit the published orders, and lowering inserts exactly the needed messages."""

from collections import Counter

import pytest

from autopart.ir.errors import ConfigError, ScheduleError
from autopart.schedule import (
    SCHEDULE_KINDS,
    Action,
    Kind,
    add_communication,
    build_schedule,
    stage_placement,
)


def _text(schedule: dict[int, list[Action]]) -> dict[int, str]:
    return {rank: " ".join(str(a) for a in actions) for rank, actions in schedule.items()}


def _parse(rows: dict[int, str]) -> dict[int, list[Action]]:
    return {rank: [Action.parse(t) for t in row.split()] for rank, row in rows.items()}


GOLDEN = [
    (
        "gpipe",
        2,
        3,
        1,
        {0: "0F0 0F1 0F2 0B0 0B1 0B2", 1: "1F0 1F1 1F2 1B0 1B1 1B2"},
    ),
    (
        "1f1b",
        3,
        4,
        1,
        {
            0: "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
            1: "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
            2: "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
        },
    ),
    (
        # Qi et al. Fig. 3 (ZB-H1): the last stage holds back p−1 = 2 weight halves.
        "zb-h1",
        3,
        4,
        1,
        {
            0: "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
            1: "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
            2: "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
        },
    ),
    (
        "interleaved",
        2,
        4,
        2,
        {
            0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
            1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
        },
    ),
    ("1f1b", 1, 2, 1, {0: "0F0 0B0 0F1 0B1"}),
    ("interleaved", 1, 2, 2, {0: "0F0 1F0 1B0 0F1 0B0 1F1 1B1 0B1"}),
]


@pytest.mark.parametrize(("kind", "ranks", "microbatches", "chunks", "expected"), GOLDEN)
def test_generated_order_matches_golden(
    kind: str, ranks: int, microbatches: int, chunks: int, expected: dict[int, str]
) -> None:
    schedule = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    assert _text(schedule) == expected


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_every_rank_runs_its_own_stages_once(kind: str, ranks: int) -> None:
    chunks = {"interleaved": 3, "zbv": 2}.get(kind, 1)
    microbatches = 2 * ranks
    schedule = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    assert sorted(schedule) == list(range(ranks))
    backward = {Kind.I, Kind.W} if kind in ("zb-h1", "zbv") else {Kind.B}
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    for rank, actions in schedule.items():
        assert all(a.is_compute for a in actions)
        assert all(placement[a.stage] == rank for a in actions)
        counts = Counter((a.stage, a.kind) for a in actions)
        stages = [s for s, home in enumerate(placement) if home == rank]
        expected = {(s, k): microbatches for s in stages for k in {Kind.F} | backward}
        assert counts == expected


@pytest.mark.parametrize(
    ("kind", "ranks", "microbatches", "chunks", "message"),
    [
        ("pipedream", 2, 4, 1, "unknown schedule 'pipedream'; use --schedule with one of gpipe"),
        ("1f1b", 0, 4, 1, r"pipeline degree must be at least 1 \(got 0\)"),
        ("1f1b", 2, 0, 1, r"at least one microbatch \(got 0\); use --microbatches 2"),
        (
            "interleaved",
            4,
            6,
            2,
            r"interleaved needs microbatches \(6\) to be a multiple of the pipeline degree "
            r"\(4\); use --microbatches 8",
        ),
        ("interleaved", 4, 8, 1, r"at least 2 model chunks per rank \(got 1\); use --chunks 2"),
        ("gpipe", 2, 4, 2, r"gpipe runs one model chunk per rank \(got 2\); use --chunks 1"),
        ("zbv", 2, 4, 3, r"zbv runs exactly 2 model chunks per rank in a V \(got 3\); use --chunks 2"),
        ("zbv", 4, 6, 2, r"zbv needs at least 2 x pp - 1 = 7 microbatches .* use --microbatches 8"),
        ("zb-h1", 2, 4, 3, r"zb-h1 runs one model chunk per rank \(got 3\)"),
    ],
)
def test_invalid_combinations_raise_one_line_config_errors(
    kind: str, ranks: int, microbatches: int, chunks: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    assert "\n" not in str(info.value)


def test_lowering_two_ranks_golden() -> None:
    schedule = build_schedule("1f1b", ranks=2, microbatches=2)
    assert _text(add_communication(schedule, ranks=2)) == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        1: "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    }


def test_lowering_sends_after_input_gradient_half() -> None:
    lowered = add_communication(build_schedule("zb-h1", ranks=2, microbatches=1), ranks=2)
    assert _text(lowered) == {
        0: "0F0 0SEND_F0 0RECV_B0 0I0 0W0",
        1: "1RECV_F0 1F0 1I0 1SEND_B0 1W0",
    }


def test_lowering_skips_stages_on_the_same_rank() -> None:
    # One rank, two chunks: every hand-over is local, so nothing is inserted.
    schedule = build_schedule("interleaved", ranks=1, microbatches=2, chunks=2)
    assert add_communication(schedule, ranks=1) == schedule
    # Two ranks, two chunks: stage 1 -> 2 crosses from rank 1 to rank 0 and back.
    lowered = add_communication(
        build_schedule("interleaved", ranks=2, microbatches=2, chunks=2), ranks=2
    )
    comms = Counter(a.kind for actions in lowered.values() for a in actions if not a.is_compute)
    boundaries, microbatches = 3, 2
    assert comms == {
        k: boundaries * microbatches for k in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)
    }


def test_lowering_places_receive_right_before_and_send_right_after() -> None:
    lowered = add_communication(
        build_schedule("interleaved", ranks=4, microbatches=8, chunks=2), ranks=4
    )
    for actions in lowered.values():
        for step, action in enumerate(actions):
            if action.kind in (Kind.RECV_F, Kind.RECV_B):
                consumer = actions[step + 1]
                assert consumer.stage == action.stage and consumer.microbatch == action.microbatch
                assert consumer.kind is (Kind.F if action.kind is Kind.RECV_F else Kind.B)
            if action.kind in (Kind.SEND_F, Kind.SEND_B):
                producer = actions[step - 1]
                assert producer.stage == action.stage and producer.microbatch == action.microbatch


def test_lowering_rejects_lowered_or_misplaced_input() -> None:
    with pytest.raises(ScheduleError, match="already a communication action"):
        add_communication(_parse({0: "0F0 0SEND_F0"}), ranks=2)
    with pytest.raises(ScheduleError, match="belongs on rank 1"):
        add_communication(_parse({0: "0F0 1F0"}), ranks=2)


def test_zbv_places_its_stages_in_a_v() -> None:
    # Down the ranks and back up: the first stage and the loss on rank 0, the turn on the last rank.
    assert stage_placement("zbv", ranks=4, chunks=2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert stage_placement("interleaved", ranks=4, chunks=2) == (0, 1, 2, 3, 0, 1, 2, 3)
    lowered = add_communication(build_schedule("zbv", ranks=2, microbatches=4, chunks=2), ranks=2,
                                placement=stage_placement("zbv", ranks=2, chunks=2))
    # stages 1 and 2 share rank 1: the turn hands its tensors over in memory, without a message
    assert not any(a.kind in (Kind.SEND_F, Kind.RECV_F) and a.stage in (1, 2) and a.peer_stage in (1, 2)
                   for actions in lowered.values() for a in actions)
    assert Action.parse("0SEND_F0") in lowered[0] and Action.parse("3SEND_B0") in lowered[0]
