"""One count of the microbatches in flight: the closed form the compiler and the search both use
(`autopart.predict.in_flight`) against the schedule simulated, as the compiler once counted it."""

import pytest

from autopart.predict.in_flight import in_flight, transient
from autopart.predict.timeline import simulate_pipeline
from autopart.passes.recompute import transient_microbatches
from autopart.schedule import build_schedule


def _simulated(kind: str, ranks: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    """Peaks read off the simulated timeline, with backward twice a forward and no transfer time."""
    stages = ranks * chunks
    timeline = simulate_pipeline(kind=kind, ranks=ranks, microbatches=microbatches, chunks=chunks,
                                 forward_s=(1.0,) * stages, backward_s=(2.0,) * stages, weight_s=(1.0,) * stages,
                                 transfer_s=(0.0,) * (stages - 1))
    return timeline.peak_in_flight


CASES = [(kind, ranks, microbatches, 1) for kind in ("gpipe", "1f1b", "zb-h1")
         for ranks in (1, 2, 3, 4, 8) for microbatches in (1, 2, 3, 4, 8, 12)]
CASES += [("interleaved", ranks, microbatches, chunks) for ranks in (2, 4) for chunks in (2, 4)
          for microbatches in (ranks, 2 * ranks, 3 * ranks)]


@pytest.mark.parametrize(("kind", "ranks", "microbatches", "chunks"), CASES)
def test_closed_form_is_the_simulated_count(kind, ranks, microbatches, chunks):
    assert in_flight(kind, ranks, microbatches, chunks) == _simulated(kind, ranks, microbatches, chunks)


@pytest.mark.parametrize(("kind", "ranks", "microbatches", "chunks"), CASES)
def test_transient_is_the_schedules_count(kind, ranks, microbatches, chunks):
    schedule = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    assert transient(kind, ranks, microbatches, chunks) == transient_microbatches(schedule, ranks * chunks)
