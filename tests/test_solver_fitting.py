"""Cuts within memory where the balanced start breaks it, and a bound below which no cut goes."""

from __future__ import annotations

import itertools
import random

import pytest

from autopart.ir.errors import InfeasibleError
from autopart.solve.fitting import fitting_cuts, memory_lower_bound, no_fit_message, spread_cuts
from autopart.solve.pipeline import PipelineProblem, evaluate, solve_cuts


def interleaved_problem(blocks: int, *, ranks: int, chunks: int, limit: int, seed: int = 0) -> PipelineProblem:
    """A chain of alike layers on ``ranks`` ranks of ``chunks`` stages each, the first stages keeping
    many microbatches in flight and the last few (as interleaved 1F1B does)."""
    rng = random.Random(seed)
    stages = ranks * chunks
    return PipelineProblem(
        block_time_s=tuple(rng.uniform(0.9e-3, 1.1e-3) for _ in range(blocks)),
        block_activation_bytes=tuple(rng.randint(90, 110) * 1000 for _ in range(blocks)),
        boundary_transfer_s=(1e-4,) * (blocks - 1),
        parameter_state_bytes={f"p{k}": 50_000 for k in range(blocks)},
        block_parameters=tuple((f"p{k}",) for k in range(blocks)),
        stages=stages,
        microbatches=16,
        in_flight=tuple(max(1, 2 * ranks - s) if s < stages // 2 else max(1, stages - s) for s in range(stages)),
        memory_limit_bytes=limit,
        stage_rank=tuple(s % ranks for s in range(stages)),
    )


def _least_memory(problem: PipelineProblem) -> int:
    blocks = len(problem.block_time_s)
    return min(
        max(evaluate(problem, cuts).rank_memory_bytes)
        for cuts in itertools.combinations(range(blocks - 1), problem.stages - 1)
    )


def test_cuts_that_fit_are_found_where_the_balanced_ones_do_not():
    roomy = interleaved_problem(24, ranks=2, chunks=3, limit=1 << 40)
    need = _least_memory(roomy)
    problem = interleaved_problem(24, ranks=2, chunks=3, limit=round(need * 1.05))
    balanced = evaluate(problem, tuple(range(3, 23, 4))[:5])
    assert max(balanced.rank_memory_bytes) > problem.memory_limit_bytes  # the even split does not fit
    cuts = fitting_cuts(problem)
    assert cuts is not None
    assert max(evaluate(problem, cuts).rank_memory_bytes) <= problem.memory_limit_bytes
    solution = solve_cuts(problem, time_limit_s=5)
    assert max(solution.evaluation.rank_memory_bytes) <= problem.memory_limit_bytes


@pytest.mark.parametrize("seed", range(4))
def test_no_cut_needs_less_than_the_bound(seed):
    problem = interleaved_problem(12, ranks=2, chunks=2, limit=1 << 40, seed=seed)
    assert memory_lower_bound(problem) <= _least_memory(problem)


def test_spread_cuts_are_cuts():
    problem = interleaved_problem(40, ranks=4, chunks=3, limit=1 << 40)
    cuts = spread_cuts(problem)
    assert len(cuts) == problem.stages - 1
    assert all(a < b for a, b in zip(cuts, cuts[1:])) and 0 <= cuts[0] and cuts[-1] < 39


def test_a_model_that_cannot_fit_says_so_in_one_line():
    roomy = interleaved_problem(12, ranks=2, chunks=2, limit=1 << 40)
    problem = interleaved_problem(12, ranks=2, chunks=2, limit=memory_lower_bound(roomy) // 2)
    assert fitting_cuts(problem) is None
    message = no_fit_message(problem, 1.0, upper_bytes=1 << 40)
    assert "\n" not in message and "no cut fits" in message and "--recompute" in message
    with pytest.raises(InfeasibleError):
        solve_cuts(problem, time_limit_s=2)


def test_a_time_limited_solve_ends_no_worse_than_the_searchs_cutter():
    """Balanced cuts break the limit and the cuts fitted from the last stage back are slow; the
    search's cutter (bisection on the slowest stage) fits and is faster. With no time to improve
    on its start, CP-SAT ends on the cutter's cuts, not on the slow ones."""
    from dataclasses import replace

    from autopart.solve.fitting import cutter_cuts

    base = interleaved_problem(37, ranks=2, chunks=3, limit=1 << 40, seed=53)
    balanced = (5, 12, 18, 24, 30)  # each stage about a sixth of the compute, as solve_cuts starts by default
    problem = replace(base, memory_limit_bytes=int(0.95 * max(evaluate(base, balanced).rank_memory_bytes)))
    cutter = evaluate(problem, cutter_cuts(problem))
    assert max(cutter.rank_memory_bytes) <= problem.memory_limit_bytes
    assert evaluate(problem, fitting_cuts(problem)).objective_s > 1.5 * cutter.objective_s
    solution = solve_cuts(problem, time_limit_s=0.01)
    assert solution.evaluation.objective_s <= cutter.objective_s
    assert solve_cuts(problem, time_limit_s=20).evaluation.objective_s <= solution.evaluation.objective_s


def test_the_search_s_cutter_pays_for_a_layer_it_splits():
    """At ZeRO-3 a cut inside a layer makes its halves hold their parameters whole: the cutter
    counts that, and so starts CP-SAT from cuts that fit rather than none (the balanced cut,
    after block 3, splits the layer of blocks 3 to 5 and no longer fits)."""
    from autopart.solve.fitting import cutter_cuts

    problem = PipelineProblem(
        block_time_s=(1.0, 1.0, 1.0, 1.0, 1.0, 3.0), block_activation_bytes=(1,) * 6, boundary_transfer_s=(0.0,) * 5,
        parameter_state_bytes={f"p{k}": 10 for k in range(6)}, block_parameters=tuple((f"p{k}",) for k in range(6)),
        stages=2, microbatches=1, in_flight=(1, 1), memory_limit_bytes=100,
        split_layers=((3, 6, ((100, (3,)), (100, (4,)), (100, (5,)))),),
    )  # fmt: skip
    assert max(evaluate(problem, (3,)).rank_memory_bytes) > 100  # the fastest cut, split
    assert cutter_cuts(problem) == (2,)
    assert evaluate(problem, (2,)).objective_s == min(
        evaluate(problem, (c,)).objective_s for c in range(5) if max(evaluate(problem, (c,)).rank_memory_bytes) <= 100)


def _rebuilding(limit: int, *, stage_rank: tuple[int, ...] = (), rebuilt: tuple[int, ...] = (100_000,) * 6
                ) -> PipelineProblem:
    """Six blocks alike in time whose recompute rebuilds ``rebuilt`` bytes each in backward; nothing else held."""
    stages = len(stage_rank) if stage_rank else 2
    return PipelineProblem(
        block_time_s=(1e-3,) * 6, block_activation_bytes=(0,) * 6, boundary_transfer_s=(0.0,) * 5,
        parameter_state_bytes={}, block_parameters=((),) * 6, stages=stages, microbatches=4,
        in_flight=(1,) * stages, memory_limit_bytes=limit, stage_rank=stage_rank,
        block_rebuilt_bytes=rebuilt, rebuilt_at_once=(1,) * stages,
    )


def test_the_solver_holds_what_a_stage_s_recompute_rebuilds():
    """A first block that rebuilds 300 kB: the balanced cut (3 and 3 blocks) holds 320 kB in its
    first stage's backward; under a 305 kB limit only the first block alone in its stage fits,
    slower as it is, and under 250 kB nothing does."""
    heavy_first = (300_000,) + (10_000,) * 5
    assert evaluate(_rebuilding(10**9, rebuilt=heavy_first), (2,)).rank_memory_bytes == (320_000, 30_000)
    assert solve_cuts(_rebuilding(10**9, rebuilt=heavy_first), time_limit_s=5).evaluation.cuts == (2,)
    assert solve_cuts(_rebuilding(305_000, rebuilt=heavy_first), time_limit_s=5).evaluation.cuts == (0,)
    with pytest.raises(InfeasibleError, match=r"needs 0\.0002794 GiB"):  # 300 kB
        solve_cuts(_rebuilding(250_000, rebuilt=heavy_first), time_limit_s=5)


def test_a_rank_of_several_stages_holds_the_largest_one_s_rebuilt_bytes():
    """Two stages on one rank (interleaved): their backwards run one at a time."""
    problem = _rebuilding(250_000, stage_rank=(0, 1, 0, 1))
    memory = evaluate(problem, (0, 2, 4)).rank_memory_bytes  # stages of 1, 2, 2 and 1 blocks
    assert memory == (200_000, 200_000)
    solved = solve_cuts(problem, time_limit_s=5).evaluation
    assert max(solved.rank_memory_bytes) <= 250_000 and max(len(r) for r in _ranges(solved.cuts)) <= 2


def _ranges(cuts: tuple[int, ...]) -> list[range]:
    starts = [0, *(c + 1 for c in cuts)]
    return [range(a, b) for a, b in zip(starts, [*(c + 1 for c in cuts), 6])]


@pytest.mark.parametrize("seed", range(4))
def test_the_heuristics_count_what_a_recompute_rebuilds(seed):
    """Interleaved ranks whose blocks each rebuild about as much as they keep: the bound stays
    below every cut's need (and above the bound that leaves them out), and the cuts found to fit
    under a limit 5% above the least need do fit."""
    from dataclasses import replace

    rng = random.Random(seed)
    plain = interleaved_problem(12, ranks=2, chunks=2, limit=1 << 40, seed=seed)
    roomy = replace(plain, block_rebuilt_bytes=tuple(rng.randint(80, 120) * 1000 for _ in range(12)),
                    rebuilt_at_once=(1,) * plain.stages)
    need = _least_memory(roomy)
    assert memory_lower_bound(plain) < memory_lower_bound(roomy) <= need
    problem = replace(roomy, memory_limit_bytes=round(need * 1.05))
    assert len(spread_cuts(problem)) == problem.stages - 1
    found = fitting_cuts(problem)
    assert found is None or max(evaluate(problem, found).rank_memory_bytes) <= problem.memory_limit_bytes
    solved = solve_cuts(problem, time_limit_s=5).evaluation
    assert max(solved.rank_memory_bytes) <= problem.memory_limit_bytes
