"""A large vocabulary head: the cuts balance time, not layer counts."""

from pathlib import Path

from autopart.driver import CompileOptions
from autopart.passes.front import build_front
from autopart.solve.assemble import pipeline_problem
from autopart.predict.timeline import simulate_pipeline
from autopart.solve.baselines import block_layers, uniform_layer_cuts
from autopart.solve.pipeline import evaluate, solve_cuts, stage_ranges

MODEL = Path(__file__).parent / "models" / "big_head.py"


def _step_s(front, problem, cuts, options):
    ranges = stage_ranges(cuts, len(front.chain.blocks))
    blocks = front.chain.blocks
    return simulate_pipeline(
        kind=options.schedule, ranks=options.pp, microbatches=problem.microbatches, chunks=1,
        forward_s=tuple(sum(blocks[k].forward_s for k in r) for r in ranges),
        backward_s=tuple(sum(blocks[k].backward_s for k in r) for r in ranges),
        weight_s=tuple(sum(blocks[k].backward_weight_s for k in r) for r in ranges),
        transfer_s=tuple(problem.boundary_transfer_s[c] for c in cuts),
    ).step_s


def test_cuts_balance_time_not_layers():
    options = CompileOptions(model=MODEL, pp=4, microbatches=8, micro_batch_size=2, device="a100-80gb")  # no calibration of a busy CPU
    front = build_front(options, 2)
    problem = pipeline_problem(options, front, 8)
    layers = block_layers(front.chain)
    assert sum(1 for layer in dict.fromkeys(layers) if layer) == 8

    ours = solve_cuts(problem, time_limit_s=20).evaluation
    uniform = evaluate(problem, uniform_layer_cuts(front.chain, 4))
    # the head is the slowest block by far, so the last stage gets fewer layers than the others
    layers_per_stage = [len({layers[k] for k in r} - {None}) for r in stage_ranges(ours.cuts, len(layers))]
    assert layers_per_stage[-1] < max(layers_per_stage[:-1]), layers_per_stage
    assert ours.objective_s < 0.9 * uniform.objective_s
    assert max(ours.stage_time_s) < max(uniform.stage_time_s)
    assert _step_s(front, problem, ours.cuts, options) < _step_s(front, problem, uniform.cuts, options)
