"""A pipeline's lowered schedule is built and validated once per shape, and simulating through it
gives what a schedule built afresh gives."""

from __future__ import annotations

import pytest

from autopart.ir.errors import ScheduleError
from autopart.predict.timeline import lowered_schedule, simulate_pipeline
from autopart.schedule import StageCosts, add_communication, build_schedule, simulate


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
    assert lowered_schedule(kind, ranks, microbatches, chunks) is lowered_schedule(kind, ranks, microbatches, chunks)


def test_costs_for_stages_the_schedule_lacks_are_refused() -> None:
    with pytest.raises(ScheduleError):
        simulate_pipeline(kind="1f1b", ranks=2, microbatches=2, chunks=1, forward_s=(1.0,) * 3, backward_s=(2.0,) * 3,
                          weight_s=(1.0,) * 3, transfer_s=(0.0,) * 2)
