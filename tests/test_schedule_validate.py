"""validate() accepts every generated schedule and names each kind of broken one."""

import pytest

from autopart.ir.errors import ScheduleError
from autopart.schedule import (
    Action,
    Kind,
    add_communication,
    build_schedule,
    format_grid,
    stage_rank,
    validate,
)


def _parse(rows: dict[int, str]) -> dict[int, list[Action]]:
    return {rank: [Action.parse(t) for t in row.split()] for rank, row in rows.items()}


def _cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for ranks in range(1, 9):
        for microbatches in sorted({1, 2, ranks, 2 * ranks + 1}):
            cases += [(kind, ranks, microbatches, 1) for kind in ("gpipe", "1f1b", "zb-h1")]
        for chunks in (2, 3):
            cases += [("interleaved", ranks, m, chunks) for m in (ranks, 2 * ranks)]
    return cases


@pytest.mark.parametrize(("kind", "ranks", "microbatches", "chunks"), _cases())
def test_every_generated_schedule_validates(
    kind: str, ranks: int, microbatches: int, chunks: int
) -> None:
    schedule = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    stages = ranks * chunks
    validate(schedule, ranks=ranks, stages=stages, microbatches=microbatches)
    lowered = add_communication(schedule, ranks=ranks)
    validate(lowered, ranks=ranks, stages=stages, microbatches=microbatches)
    # Between each pair of ranks the receives come in the order of the sends, so a transport
    # that matches messages by order (NCCL ignores tags) pairs every message correctly.
    for src in range(ranks):
        for dst in range(ranks):
            sent = [
                (a.stage + (1 if a.kind is Kind.SEND_F else -1), a.microbatch)
                for a in lowered[src]
                if a.kind in (Kind.SEND_F, Kind.SEND_B)
                and stage_rank(a.stage + (1 if a.kind is Kind.SEND_F else -1), ranks) == dst
            ]
            received = [
                (a.stage, a.microbatch)
                for a in lowered[dst]
                if a.kind in (Kind.RECV_F, Kind.RECV_B)
                and stage_rank(a.stage + (-1 if a.kind is Kind.RECV_F else 1), ranks) == src
            ]
            assert sent == received


ONE_F_ONE_B = {0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0 1F1 1B1"}
LOWERED = {
    0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
    1: "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
}

# (what is broken, schedule rows, ranks, stages, expected message, marked (rank, step) or None)
# fmt: off
BROKEN = [
    ("foreign rank", {0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0 1F1 1B1", 2: ""}, 2, 2,
     "has rank 2 but the pipeline has 2 ranks", None),
    ("wrong rank", {0: "0F0 0F1 1F0 0B0 0B1", 1: "1B0 1F1 1B1"}, 2, 2,
     r"rank 0, step 2: 1F0 is on the wrong rank: stage 1 lives on rank 1", (0, 2)),
    ("stage out of range", {0: "0F0 0F1 0B0 0B1 2F0", 1: "1F0 1B0 1F1 1B1"}, 2, 2,
     "names stage 2 but the pipeline has 2 stages", (0, 4)),
    ("microbatch out of range", {0: "0F0 0F1 0B0 0B1 0F2", 1: "1F0 1B0 1F1 1B1"}, 2, 2,
     "names microbatch 2 but the step has 2", (0, 4)),
    ("missing forward", {0: "0F0 0B0 0B1", 1: "1F0 1B0 1F1 1B1"}, 2, 2,
     r"stage 0, microbatch 1 never runs its forward \(0F1 is missing\)", None),
    ("repeated forward", {0: "0F0 0F1 0F1 0B0 0B1", 1: "1F0 1B0 1F1 1B1"}, 2, 2,
     r"rank 0, step 2: 0F1 is repeated \(first at rank 0, step 1\)", (0, 2)),
    ("missing backward", {0: "0F0 0F1 0B0", 1: "1F0 1B0 1F1 1B1"}, 2, 2,
     "stage 0, microbatch 1 never runs its backward", None),
    ("repeated backward", {0: "0F0 0F1 0B0 0B1 0B1", 1: "1F0 1B0 1F1 1B1"}, 2, 2,
     "0B1 is repeated", (0, 4)),
    ("B and I", {0: "0F0 0F1 0B0 0B1 0I1 0W1", 1: "1F0 1B0 1F1 1B1"}, 2, 2,
     "runs its backward twice: 0B1 and 0I1", (0, 4)),
    ("I without W", {0: "0F0 0F1 0B0 0I1", 1: "1F0 1B0 1F1 1B1"}, 2, 2,
     "has 0I1 but no 0W1", (0, 3)),
    ("W before I", {0: "0F0 0F1 0B0 0W1 0I1", 1: "1F0 1B0 1F1 1B1"}, 2, 2,
     "rank 0, step 3: 0W1 runs before 0I1", (0, 3)),
    ("backward before forward", {0: "0F0 0F1 0B0 0B1", 1: "1B0 1F0 1F1 1B1"}, 2, 2,
     "rank 1, step 0: 1B0 runs before 1F0", (1, 0)),
    ("forward before previous stage, same rank", {0: "1F0 0F0 1B0 0B0"}, 1, 2,
     "rank 0, step 0: 1F0 runs before 0F0", (0, 0)),
    ("backward before next stage, same rank", {0: "0F0 1F0 0B0 1B0"}, 1, 2,
     "rank 0, step 2: 0B0 runs before 1B0", (0, 2)),
    ("cross-rank circular wait", {0: "0F0 0B0 0F1 0B1", 1: "1F0 1F1 1B0 1B1"}, 2, 2,
     r"deadlock: rank 0 waits at step 1 \(0B0\) for 1B0 on rank 1; rank 1 waits at step 1 "
     r"\(1F1\) for 0F1 on rank 0", (0, 1)),
    ("receive without send", {**LOWERED, 0: LOWERED[0].replace("0SEND_F1 ", "")}, 2, 2,
     r"rank 1, step 4: 1RECV_F1 has no matching SEND \(0SEND_F1 is missing\)", (1, 4)),
    ("send without receive", {**LOWERED, 0: LOWERED[0].replace("0RECV_B0 ", "")}, 2, 2,
     "rank 0, step 4: 0B0 needs 1B0 from rank 1 but no 0RECV_B0 comes before it", (0, 4)),
    ("send never received", {**LOWERED, 1: LOWERED[1].replace("1RECV_F1 ", "")}, 2, 2,
     r"rank 0, step 3: 0SEND_F1 is never received \(1RECV_F1 is missing\)", (0, 3)),
    ("repeated send", {**LOWERED, 0: LOWERED[0] + " 0SEND_F1"}, 2, 2,
     "0SEND_F1 is repeated", (0, 8)),
    ("receive after its consumer",
     {**LOWERED, 1: LOWERED[1].replace("1RECV_F0 1F0", "1F0 1RECV_F0")}, 2, 2,
     "rank 1, step 0: 1F0 needs 0F0 from rank 0 but no 1RECV_F0 comes before it", (1, 0)),
    ("send of a local hand-over", {0: "0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0"}, 1, 2,
     "0SEND_F0 talks to stage 1 on the same rank", (0, 1)),
    ("lowered deadlock",
     {**LOWERED, 0: "0F0 0RECV_B0 0SEND_F0 0F1 0SEND_F1 0B0 0RECV_B1 0B1"}, 2, 2,
     r"deadlock: rank 0 waits at step 1 \(0RECV_B0\) for 1SEND_B0 on rank 1; rank 1 waits at "
     r"step 0 \(1RECV_F0\) for 0SEND_F0 on rank 0", (0, 1)),
]
# fmt: on


@pytest.mark.parametrize(
    ("rows", "ranks", "stages", "message", "mark"),
    [case[1:] for case in BROKEN],
    ids=[case[0] for case in BROKEN],
)
def test_validate_names_the_problem(
    rows: dict[int, str], ranks: int, stages: int, message: str, mark: tuple[int, int] | None
) -> None:
    schedule = _parse(rows)
    with pytest.raises(ScheduleError, match=message) as info:
        validate(schedule, ranks=ranks, stages=stages, microbatches=2 if ranks == 2 else 1)
    assert "\n" not in str(info.value)
    grid_lines = info.value.grid.splitlines()  # type: ignore[attr-defined]
    marked = [i - 1 for i, line in enumerate(grid_lines) if "<-- ERROR HERE" in line]
    assert marked == ([] if mark is None else [mark[1]])
    if mark is not None:
        assert f"(rank {mark[0]})" in grid_lines[mark[1] + 1]


def test_unlowered_and_lowered_references_are_valid() -> None:
    validate(_parse(ONE_F_ONE_B), ranks=2, stages=2, microbatches=2)
    validate(_parse(LOWERED), ranks=2, stages=2, microbatches=2)


def test_format_grid_lays_ranks_out_as_columns() -> None:
    grid = format_grid(_parse(ONE_F_ONE_B), mark=(1, 2))
    assert grid.splitlines() == [
        "        Rank 0 Rank 1",
        "Step 0: 0F0    1F0",
        "Step 1: 0F1    1B0",
        "Step 2: 0B0    1F1  <-- ERROR HERE (rank 1)",
        "Step 3: 0B1    1B1",
    ]
    assert format_grid({}) == "(empty schedule)\n"
