"""The closed-form peaks of in-flight microbatches are the simulated schedules' peaks."""

from __future__ import annotations

import numpy as np
import pytest

from autopart.predict.timeline import simulate_pipeline
from autopart.schedule import peaks
from autopart.schedule.peaks import peak_in_flight, transient_in_flight


def simulated(kind: str, ranks: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    stages = ranks * chunks
    return simulate_pipeline(kind=kind, ranks=ranks, microbatches=microbatches, chunks=chunks,
                             forward_s=(1.0,) * stages, backward_s=(2.0,) * stages, weight_s=(1.0,) * stages,
                             transfer_s=(0.0,) * (stages - 1)).peak_in_flight


CASES = [
    (kind, p, m, 1) for kind in ("gpipe", "1f1b", "zb-h1") for p in (1, 3, 5) for m in sorted({1, p, 2 * p + 1})
] + [
    ("zbv", p, m, 2) for p in (1, 2, 3, 5) for m in sorted({2 * p - 1, 2 * p, 3 * p + 1})
] + [("interleaved", p, m, v) for p in (2, 3, 4) for v in (2, 3) for m in (p, 3 * p)] + [("interleaved", 4, 8, 4)]


@pytest.mark.parametrize(("kind", "ranks", "microbatches", "chunks"), CASES)
def test_closed_form_peaks_match_the_simulation(kind: str, ranks: int, microbatches: int, chunks: int) -> None:
    assert peak_in_flight(kind, ranks=ranks, microbatches=microbatches, chunks=chunks) == simulated(
        kind, ranks, microbatches, chunks)


def test_one_f_one_b_holds_fewer_than_gpipe() -> None:
    assert peak_in_flight("1f1b", ranks=4, microbatches=16) == (4, 3, 2, 1)
    assert peak_in_flight("gpipe", ranks=4, microbatches=16) == (16,) * 4


@pytest.mark.parametrize(("kind", "ranks", "microbatches", "chunks"), CASES)
def test_closed_form_transients_match_the_action_lists(kind: str, ranks: int, microbatches: int, chunks: int) -> None:
    from autopart.passes.recompute import transient_microbatches
    from autopart.schedule import build_schedule

    schedule = build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks)
    assert transient_in_flight(kind, ranks=ranks, microbatches=microbatches, chunks=chunks) == transient_microbatches(
        schedule, ranks * chunks)


@pytest.mark.parametrize("kind, chunks, shown", [("zbv", 2, 2), ("interleaved", 3, 3)])
def test_microbatch_counts_that_show_the_same_moments_are_walked_once(kind: str, chunks: int, shown: int) -> None:
    """ZB-V shows all its moments by 2p microbatches and interleaved by 3p; the search asks for
    hundreds of counts beyond, and each would walk the same action lists again."""
    from autopart.schedule import peaks

    p = 4
    first = peaks.rank_peaks(kind, ranks=p, microbatches=shown * p, chunks=chunks)
    walked = peaks._walked if kind == "zbv" else peaks._interleaved_candidates
    before = walked.cache_info()
    for m in (shown * p + p, 10 * p, 25 * p):
        assert peaks.rank_peaks(kind, ranks=p, microbatches=m, chunks=chunks) == first
    after = walked.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 3


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_interleaved_peaks_read_off_the_rank_moments_equal_the_step_count(ranks: int, chunks: int) -> None:
    for rounds in range(1, 9):  # past the 3p microbatches whose moments stand for any more
        microbatches = rounds * ranks
        assert peak_in_flight("interleaved", ranks=ranks, microbatches=microbatches, chunks=chunks) \
            == peaks._interleaved_counted(ranks, microbatches, chunks)


def _every_moment_candidates(p: int, m: int, v: int) -> tuple:
    """``_peak_candidates`` of interleaved 1F1B over every moment of every rank: the start, then
    after each of its ``m·v`` steady forwards."""
    total = m * v
    steps = np.arange(total)
    warmup = np.minimum((v - 1) * p + 2 * (p - 1 - np.arange(p)), total)[:, None]
    forwards = np.minimum(warmup + steps + 1, total)
    after = np.stack([peaks._units(forwards, c, p, v) - peaks._units(steps, v - 1 - c, p, v) for c in range(v)], axis=2)
    start = np.stack([peaks._units(warmup, c, p, v) for c in range(v)], axis=2)
    return peaks._peak_candidates(np.concatenate([start, after], axis=1))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7, 12])
@pytest.mark.parametrize("chunks", [2, 3, 4, 6])
def test_interleaved_moments_read_at_their_turning_steps_are_those_of_every_step(ranks: int, chunks: int) -> None:
    """Reading a rank's counts only where a chunk's round begins or ends finds the same peak
    candidates as reading them after every step, for every microbatch count up to 3p and past it."""
    for microbatches in sorted({*range(1, 3 * ranks + 2), 4 * ranks}):
        assert peaks._interleaved_candidates.__wrapped__(ranks, microbatches, chunks) \
            == _every_moment_candidates(ranks, microbatches, chunks), microbatches
