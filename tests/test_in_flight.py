"""One count of the microbatches in flight: the closed form the compiler and the search both use
(`autopart.predict.in_flight`) against the schedule simulated, as the compiler once counted it,
and what a rank of several stages holds at once against its action lists. A microbatch is held
from its forward to its whole backward or its weight half (W): its input half keeps the graph."""

import random

import pytest

from autopart.predict.in_flight import in_flight, rank_in_flight, transient
from autopart.predict.timeline import simulate_pipeline
from autopart.ir.actions import Kind
from autopart.passes.recompute import transient_microbatches
from autopart.schedule import build_schedule, stage_placement


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


def _walked_moments(kind: str, ranks: int, microbatches: int, chunks: int) -> dict[int, list[tuple[int, ...]]]:
    """Per rank, what its stages hold after each forward, read off the action lists it executes in order."""
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    found = {}
    for rank, actions in build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=chunks).items():
        mine = [s for s, home in enumerate(placement) if home == rank]
        live, found[rank] = dict.fromkeys(mine, 0), []
        for action in actions:
            if action.kind is Kind.F:
                live[action.stage] += 1
                found[rank].append(tuple(live[s] for s in mine))
            elif action.kind in (Kind.B, Kind.W):  # an I keeps the graph, and so the activations, for its W
                live[action.stage] -= 1
    return found


RANK_CASES = [(kind, 3, 5, 1) for kind in ("gpipe", "1f1b", "zb-h1")]
RANK_CASES += [("zbv", ranks, m, 2) for ranks, m in ((2, 4), (3, 7), (4, 12), (5, 31), (8, 40))]  # past 2p: one round shows all
RANK_CASES += [("interleaved", ranks, m, chunks) for ranks in (2, 4) for chunks in (2, 3) for m in (ranks, 3 * ranks)]


@pytest.mark.parametrize(("kind", "ranks", "microbatches", "chunks"), RANK_CASES)
def test_rank_moments_cover_what_the_action_lists_hold(kind, ranks, microbatches, chunks):
    """However many bytes a microbatch weighs on each stage, no moment of a rank's action list
    holds more than the most of its moments, the fullest is one of them, and each stage's own
    peak is the most it holds at any of them."""
    moments = rank_in_flight(kind, ranks, microbatches, chunks)
    peaks = in_flight(kind, ranks, microbatches, chunks)
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    for rank, walked in _walked_moments(kind, ranks, microbatches, chunks).items():
        assert_holds_the_most(moments[rank], walked)
        assert max(map(sum, moments[rank])) == max(map(sum, walked))
        mine = [s for s, home in enumerate(placement) if home == rank]
        assert [max(column) for column in zip(*moments[rank])] == [peaks[s] for s in mine]


def assert_holds_the_most(moments, walked) -> None:
    """For each stage alone, all alike and many random weightings of the stages (bytes per
    microbatch), the most that ``moments`` weigh is the most that any ``walked`` moment does,
    and every one of ``moments`` is a moment ``walked``."""
    width = len(walked[0])
    rng = random.Random(len(walked))
    weights = [[float(i == j) for j in range(width)] for i in range(width)] + [[1.0] * width]
    weights += [[rng.choice([0.0, rng.random(), rng.random() * 1e3]) for _ in range(width)] for _ in range(200)]
    for weight in weights:
        def most(rows):
            return max(sum(w * h for w, h in zip(weight, row)) for row in rows)
        assert most(moments) == pytest.approx(most(walked), rel=1e-12)
    assert set(moments) <= set(walked)


@pytest.mark.parametrize(("ranks", "chunks", "rounds"), [(2, 2, 9), (3, 3, 6), (4, 2, 5), (5, 4, 8), (8, 3, 4), (8, 6, 7)])
def test_long_interleaved_pipelines_hold_no_more_than_their_moments(ranks, chunks, rounds):
    """The moments come from 3p microbatches however many run (``INTERLEAVED_SHOWN``), and only
    where a rank's counts turn: still no moment of its action lists holds more."""
    microbatches = rounds * ranks
    moments = rank_in_flight("interleaved", ranks, microbatches, chunks)
    for rank, walked in _walked_moments("interleaved", ranks, microbatches, chunks).items():
        assert_holds_the_most(moments[rank], walked)
        assert len(moments[rank]) <= 2 * chunks  # a few turns, not the p or more moments they stand for


def test_the_first_interleaved_rank_holds_narayanans_count_not_its_chunks_peaks_summed():
    """Narayanan et al. (SC21 §2.2.2): with interleaving the first stage holds p microbatches of
    its layers times 1 + (p - 1)/(p·v), here p·v + p - 1 chunk-microbatches; each chunk reaches
    its own peak (up to 2p) at another moment, and those add up to far more."""
    p, v, m = 8, 12, 64
    first = rank_in_flight("interleaved", p, m, v)[0]
    assert max(map(sum, first)) == p * v + p - 1 == round(p * v * (1 + (p - 1) / (p * v)))
    assert sum(in_flight("interleaved", p, m, v)[c * p] for c in range(v)) == 144


def test_a_long_zbv_pipeline_bounds_each_rank_by_its_chunks_own_peaks():
    """Past ``ZBV_WALKED_RANKS`` the action lists are not walked: every moment of a rank is within
    the one moment given, its two chunks' peaks at once."""
    from autopart.schedule.peaks import ZBV_WALKED_RANKS

    ranks = ZBV_WALKED_RANKS + 1
    moments = rank_in_flight("zbv", ranks, 2 * ranks, 2)
    walked = _walked_moments("zbv", ranks, 2 * ranks, 2)
    for rank in (0, ranks // 2, ranks - 1):
        (bound,) = moments[rank]
        assert all(all(b >= w for b, w in zip(bound, row)) for row in walked[rank])


@pytest.mark.parametrize("kind, chunks", [("interleaved", 2), ("interleaved", 3), ("interleaved", 6), ("zbv", 2)])
@pytest.mark.parametrize("ranks", [2, 3, 5, 8, 40])
def test_every_stage_is_at_its_own_peak_at_one_of_its_ranks_moments(kind, chunks, ranks):
    """The search refuses a layout whose ranks cannot hold each stage's own peak
    (``autopart.solve.layout_bounds.may_fit``); the cutters hold a rank at its moments, so one
    of them must hold each of its stages at that stage's peak."""
    placement = stage_placement(kind, ranks=ranks, chunks=chunks)
    fewest = ranks if kind == "interleaved" else 2 * ranks - 1  # zbv fills its V from 2p - 1
    for microbatches in (fewest, 3 * ranks, 7 * ranks, 32 * ranks):
        peaks = in_flight(kind, ranks, microbatches, chunks)
        moments = rank_in_flight(kind, ranks, microbatches, chunks)
        mine = [[s for s, r in enumerate(placement) if r == rank] for rank in range(ranks)]
        for rank, stages in enumerate(mine):
            for i, s in enumerate(stages):
                assert max(moment[i] for moment in moments[rank]) >= peaks[s], (microbatches, rank, s)
