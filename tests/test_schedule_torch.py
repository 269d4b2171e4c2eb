"""Our schedules speak torch.distributed.pipelining's language: action strings, CSV files and
orders are checked against torch's own parser, loader, generators and simulator.

The only place autopart's schedule code meets torch; nothing here starts a process group.
"""

import types
from pathlib import Path

import pytest

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

from autopart.schedule import (  # noqa: E402
    SCHEDULE_KINDS,
    Action,
    Kind,
    add_communication,
    build_schedule,
    stage_placement,
    write_schedule_csv,
)


def test_kinds_are_torch_computation_types() -> None:
    for kind in Kind:
        assert schedules._ComputationType(kind.value).value == kind.value


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize(("stage", "microbatch"), [(0, 0), (3, 1), (11, 27)])
def test_action_strings_round_trip_through_torch(kind: Kind, stage: int, microbatch: int) -> None:
    ours = Action(stage, kind, microbatch)
    theirs = schedules._Action.from_str(str(ours))
    assert (theirs.stage_index, theirs.computation_type.value, theirs.microbatch_index) == (
        stage,
        kind.value,
        microbatch,
    )
    assert Action.parse(str(theirs)) == ours


def _torch_loader(ranks: int, stages: int, microbatches: int) -> types.SimpleNamespace:
    """Just enough of a PipelineScheduleMulti for its _load_csv, which also runs torch's
    _validate_schedule on what it loads."""
    loader = types.SimpleNamespace(
        pipeline_order={},
        pp_group_size=ranks,
        _num_stages=stages,
        _n_microbatches=microbatches,
        _stages=[],
    )
    loader._validate_and_set_stage_mapping = types.MethodType(
        schedules.PipelineScheduleMulti._validate_and_set_stage_mapping, loader
    )
    return loader


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_torch_loads_our_csv(kind: str, tmp_path: Path) -> None:
    ranks, microbatches = 3, 6
    chunks = 2 if kind in ("interleaved", "zbv") else 1
    schedule = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    path = tmp_path / "schedule.csv"
    write_schedule_csv(schedule, path)
    loader = _torch_loader(ranks, ranks * chunks, microbatches)
    schedules.PipelineScheduleMulti._load_csv(loader, str(path))
    assert {r: [str(a) for a in acts] for r, acts in loader.pipeline_order.items()} == {
        r: [str(a) for a in acts] for r, acts in schedule.items()
    }
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    assert loader.stage_index_to_group_rank == dict(enumerate(placement))


def _torch_order(cls, *, ranks: int, microbatches: int, chunks: int) -> dict[int, list[str]]:
    rounds = max(1, microbatches // ranks)
    generator = types.SimpleNamespace(
        n_local_stages=chunks,
        pp_group_size=ranks,
        _n_microbatches=microbatches,
        microbatches_per_round=microbatches // rounds,
    )
    return {
        rank: [
            str(a) for a in cls._calculate_single_rank_operations(generator, rank) if a is not None
        ]
        for rank in range(ranks)
    }


@pytest.mark.parametrize(
    ("ranks", "chunks", "microbatches"), [(1, 2, 3), (2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 4, 9)]
)
def test_interleaved_is_torch_interleaved_1f1b(ranks: int, chunks: int, microbatches: int) -> None:
    ours = build_schedule("interleaved", ranks=ranks, microbatches=microbatches, chunks=chunks)
    theirs = _torch_order(
        schedules.ScheduleInterleaved1F1B, ranks=ranks, microbatches=microbatches, chunks=chunks
    )
    assert {r: [str(a) for a in acts] for r, acts in ours.items()} == theirs


@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 2), (2, 4), (4, 2), (4, 8), (5, 10)])
def test_zb_h1_is_torch_zero_bubble_with_one_chunk(ranks: int, microbatches: int) -> None:
    ours = build_schedule("zb-h1", ranks=ranks, microbatches=microbatches)
    theirs = _torch_order(
        schedules.ScheduleInterleavedZeroBubble, ranks=ranks, microbatches=microbatches, chunks=1
    )
    assert {r: [str(a) for a in acts] for r, acts in ours.items()} == theirs


@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 1), (2, 3), (2, 4), (3, 7), (4, 8), (4, 12)])
def test_zbv_is_torch_zbv_zero_bubble(ranks: int, microbatches: int) -> None:
    ours = build_schedule("zbv", ranks=ranks, microbatches=microbatches, chunks=2)
    generator = types.SimpleNamespace(pp_group_size=ranks, _n_microbatches=microbatches, num_stages=2 * ranks)
    theirs = {
        rank: [str(a) for a in schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations(generator, rank)
               if a is not None]
        for rank in range(ranks)
    }
    assert {r: [str(a) for a in acts] for r, acts in ours.items()} == theirs


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_torch_simulator_runs_our_lowered_schedules(kind: str) -> None:
    ranks, microbatches = 4, 8
    chunks = 2 if kind in ("interleaved", "zbv") else 1
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    lowered = add_communication(
        build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks), ranks=ranks, placement=placement
    )
    theirs = {r: [schedules._Action.from_str(str(a)) for a in acts] for r, acts in lowered.items()}
    # Raises when some rank cannot progress (a receive whose send never comes first).
    simulated = schedules._simulate_comms_compute(
        theirs, lambda s: placement[s], ranks * chunks
    )
    assert sum(a is not None for acts in simulated.values() for a in acts) == sum(
        map(len, lowered.values())
    )
