"""The CP-SAT pipeline cuts against exhaustive enumeration, and their memory behaviour."""

import itertools
import random
from dataclasses import replace

import pytest

from autopart.ir.errors import ConfigError, InfeasibleError
from autopart.solve.pipeline import PipelineProblem, evaluate, solve_cuts


def _problem(rng: random.Random, blocks: int, stages: int, microbatches: int, **overrides) -> PipelineProblem:
    params = {f"p{k}": rng.randint(1, 50) * 1000 for k in range(blocks)}
    fields = dict(
        block_time_s=tuple(rng.uniform(1e-4, 5e-3) for _ in range(blocks)),
        block_activation_bytes=tuple(rng.randint(1, 40) * 1000 for _ in range(blocks)),
        boundary_transfer_s=tuple(rng.uniform(0, 1e-3) for _ in range(blocks - 1)),
        parameter_state_bytes=params,
        block_parameters=tuple((f"p{k}",) for k in range(blocks)),
        stages=stages,
        microbatches=microbatches,
        in_flight=tuple(min(stages - s, microbatches) for s in range(stages)),
        memory_limit_bytes=1 << 40,
    )
    fields.update(overrides)
    return PipelineProblem(**fields)


def _exhaustive(problem: PipelineProblem) -> float | None:
    blocks = len(problem.block_time_s)
    best = None
    for cuts in itertools.combinations(range(blocks - 1), problem.stages - 1):
        evaluation = evaluate(problem, cuts)
        if max(evaluation.rank_memory_bytes) > problem.memory_limit_bytes:
            continue
        if best is None or evaluation.objective_s < best:
            best = evaluation.objective_s
    return best


@pytest.mark.parametrize("seed", range(12))
def test_cuts_are_optimal_against_exhaustive_enumeration(seed):
    rng = random.Random(seed)
    blocks = rng.randint(4, 9)
    stages = rng.randint(2, min(4, blocks))
    problem = _problem(rng, blocks, stages, rng.choice([1, 2, 4, 8]))
    solution = solve_cuts(problem, time_limit_s=20)
    assert solution.status == "optimal"
    assert solution.evaluation.objective_s == pytest.approx(_exhaustive(problem), rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_cuts_are_optimal_under_a_binding_memory_limit(seed):
    rng = random.Random(100 + seed)
    blocks, stages = 8, 3
    free = _problem(rng, blocks, stages, 4)
    unconstrained = solve_cuts(free, time_limit_s=20).evaluation
    # a limit just under what the fastest cuts need forces other cuts
    limit = max(unconstrained.rank_memory_bytes) - 1
    problem = _problem(random.Random(100 + seed), blocks, stages, 4, memory_limit_bytes=limit)
    expected = _exhaustive(problem)
    if expected is None:
        with pytest.raises(InfeasibleError):
            solve_cuts(problem, time_limit_s=20)
        return
    solution = solve_cuts(problem, time_limit_s=20)
    assert max(solution.evaluation.rank_memory_bytes) <= limit
    assert solution.evaluation.objective_s == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("seed", range(8))
def test_a_layer_that_a_cut_splits_costs_its_stages_more_and_the_cuts_are_still_optimal(seed):
    """ZeRO-3's repeated layers (``split_layers``): a cut inside one makes each stage that reads
    its parameters pay more; CP-SAT's model counts it as ``evaluate`` does, memory limit binding."""
    rng = random.Random(200 + seed)
    blocks, stages = 8, 3
    layers = ((1, 3, ((rng.randint(10, 60) * 1000, (1,)), (rng.randint(10, 60) * 1000, (2,)))),
              (3, 6, ((rng.randint(10, 60) * 1000, (3, 5)),)))  # fmt: skip
    free = _problem(rng, blocks, stages, 4, split_layers=layers)
    assert evaluate(free, (0, 6)).rank_memory_bytes == evaluate(replace(free, split_layers=()), (0, 6)).rank_memory_bytes
    inside = evaluate(free, (1, 4)).rank_memory_bytes  # splits both: stage 0 reads block 1, stage 1 blocks 2-4
    outside = evaluate(replace(free, split_layers=()), (1, 4)).rank_memory_bytes
    assert inside[0] - outside[0] == layers[0][2][0][0]
    assert inside[1] - outside[1] == layers[0][2][1][0] + layers[1][2][0][0]
    assert inside[2] - outside[2] == layers[1][2][0][0]  # block 5 reads the parameters block 3 read
    # a limit under which the split layers' bytes change the best cuts (no cut splits a layer, or another does)
    limits = sorted({max(evaluate(free, c).rank_memory_bytes) for c in itertools.combinations(range(blocks - 1), 2)})
    problem = next(p for p in (replace(free, memory_limit_bytes=limit) for limit in limits)
                   if _exhaustive(p) != _exhaustive(replace(p, split_layers=())))
    limit = problem.memory_limit_bytes
    solution = solve_cuts(problem, time_limit_s=20)
    assert max(solution.evaluation.rank_memory_bytes) <= limit
    assert solution.evaluation.objective_s == pytest.approx(_exhaustive(problem), rel=1e-6)


def test_a_parameter_read_by_two_stages_is_held_by_both():
    rng = random.Random(7)
    problem = _problem(rng, 4, 2, 2, block_parameters=(("tied",), (), (), ("tied",)),
                       parameter_state_bytes={"tied": 1000})
    evaluation = evaluate(problem, (1,))
    activations = problem.block_activation_bytes
    assert evaluation.rank_memory_bytes[0] == 1000 + 2 * (activations[0] + activations[1])
    assert evaluation.rank_memory_bytes[1] == 1000 + 1 * (activations[2] + activations[3])


def test_heavy_last_block_gets_a_stage_of_its_own():
    # eight equal layers and a head as slow as four of them: time balance puts the head alone
    times = (1.0,) * 8 + (4.0,)
    problem = PipelineProblem(
        block_time_s=times,
        block_activation_bytes=(0,) * 9,
        boundary_transfer_s=(0.0,) * 8,
        parameter_state_bytes={},
        block_parameters=((),) * 9,
        stages=3,
        microbatches=8,
        in_flight=(3, 2, 1),
        memory_limit_bytes=1,
    )
    cuts = solve_cuts(problem, time_limit_s=10).evaluation.cuts
    assert cuts == (3, 7)


def test_infeasible_names_the_memory_that_would_fit():
    rng = random.Random(3)
    problem = _problem(rng, 6, 2, 4, memory_limit_bytes=10)
    with pytest.raises(InfeasibleError, match=r"raise --memory to at least \d+\.\d+"):
        solve_cuts(problem, time_limit_s=10)


def test_more_stages_than_blocks_is_a_config_error():
    with pytest.raises(ConfigError, match="--pp 3 or fewer"):
        _problem(random.Random(0), 3, 4, 4)


def test_a_rank_of_two_interleaved_stages_is_bounded_at_its_moments_not_at_their_peaks_summed():
    """Interleaved 1F1B on 2 ranks, 2 chunks, 4 microbatches: rank 0 holds stage 0 at its peak (4)
    while stage 2 holds 1, and stage 2 at its peak (2) while stage 0 holds 3; never 4 + 2. The
    runtime executes that order, so 5 microbatches' activations are what the rank must fit."""
    from autopart.predict.in_flight import in_flight, rank_in_flight

    ranks, chunks, microbatches = 2, 2, 4
    fields = dict(
        block_time_s=(1e-3,) * 4, block_activation_bytes=(1000,) * 4, boundary_transfer_s=(0.0,) * 3,
        parameter_state_bytes={f"p{k}": 100 for k in range(4)}, block_parameters=tuple((f"p{k}",) for k in range(4)),
        stages=4, microbatches=microbatches, in_flight=in_flight("interleaved", ranks, microbatches, chunks),
        stage_rank=(0, 1, 0, 1), memory_limit_bytes=5500,
    )  # fmt: skip
    held = PipelineProblem(**fields, rank_in_flight=rank_in_flight("interleaved", ranks, microbatches, chunks))
    assert evaluate(held, (0, 1, 2)).rank_memory_bytes == (200 + 5 * 1000, 200 + 3 * 1000)
    assert solve_cuts(held, time_limit_s=10).evaluation.cuts == (0, 1, 2)
    summed = PipelineProblem(**fields)  # every stage at its own peak at once: 6 microbatches on rank 0
    assert evaluate(summed, (0, 1, 2)).rank_memory_bytes[0] == 200 + 6 * 1000
    with pytest.raises(InfeasibleError):
        solve_cuts(summed, time_limit_s=10)


def test_a_cut_behind_which_nothing_trains_costs_no_gradient_back():
    """A boundary that no gradient crosses (a frozen prefix's, ``boundary_gradients``) costs the
    stage after it no gradient to send: four equal blocks on two stages, a transfer taking as long
    as a block, are cut in the middle (3 s a stage) where a gradient crosses every boundary, and
    after the first block (2 s and 3 s) where none crosses it. The cutters charged a gradient
    message at every boundary, as the plan's step model charges none there."""
    plain = PipelineProblem(block_time_s=(1.0,) * 4, block_activation_bytes=(1,) * 4, boundary_transfer_s=(1.0,) * 3,
                            parameter_state_bytes={}, block_parameters=((),) * 4, stages=2, microbatches=4,
                            in_flight=(2, 1), memory_limit_bytes=1 << 40)
    frozen = replace(plain, boundary_gradients=(False, True, True))
    assert evaluate(plain, (0,)).stage_time_s == (2.0, 4.0)
    assert evaluate(frozen, (0,)).stage_time_s == (2.0, 3.0)
    assert solve_cuts(plain, time_limit_s=20).evaluation.cuts == (1,)
    assert solve_cuts(frozen, time_limit_s=20).evaluation.cuts == (0,)


@pytest.mark.parametrize("seed", range(6))
def test_cuts_are_optimal_with_boundaries_no_gradient_crosses(seed):
    rng = random.Random(300 + seed)
    blocks = rng.randint(4, 9)
    stages = rng.randint(2, min(4, blocks))
    frozen = rng.randint(1, blocks - 1)  # a frozen prefix: no gradient over its boundaries
    problem = _problem(rng, blocks, stages, rng.choice([1, 2, 4, 8]),
                       boundary_gradients=tuple(k >= frozen for k in range(blocks - 1)))
    solution = solve_cuts(problem, time_limit_s=20)
    assert solution.status == "optimal"
    assert solution.evaluation.objective_s == pytest.approx(_exhaustive(problem), rel=1e-6)
