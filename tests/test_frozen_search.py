"""The search costs a fine-tune whose first layers are frozen (tests/test_frozen.py's ``PREFIX``:
a frozen embedding and three frozen blocks below three trained ones) as its plans then run."""

import pytest

from autopart.options import CompileOptions
from autopart.solve.planner import FrontTable
from tests.test_frozen import PREFIX

A100 = dict(world_size=4, microbatches=4, global_batch_size=8, device="a100-80gb", measure=False)


@pytest.fixture
def prefix(tmp_path):
    model = tmp_path / "prefix.py"
    model.write_text(PREFIX)
    return model


def test_a_trained_block_sharded_is_not_costed_as_its_frozen_twin(prefix):
    """A trained block and a frozen one of the same ops (same signature) shared one tensor-parallel
    solution, the first one's: the trained blocks after a frozen prefix were timed at TP 2 with
    the frozen block's time, no backward, under the floor no sharding of them beats (the search's
    early bound then stood above its exact one). Each kind now has its own solution."""
    table = FrontTable(CompileOptions(model=prefix, **A100))
    sharded = table.chain_costs(micro_batch_size=2, tp=2, dtype="fp32")
    floor = table.optimistic_costs(micro_batch_size=2, tp=2, dtype="fp32")
    whole = table.chain_costs(micro_batch_size=2, tp=1, dtype="fp32")
    frozen, trained = range(1, 4), range(4, 7)  # blocks 1-3 frozen, 4-6 trained, each a linear, tanh and add
    assert all(whole.backward_s[k] == 0 for k in frozen) and all(whole.backward_s[k] > 0 for k in trained)
    for k in range(len(sharded)):
        assert sharded.forward_s[k] + sharded.backward_s[k] >= (floor.forward_s[k] + floor.backward_s[k]) * (1 - 1e-9), k
    assert min(sharded.backward_s[k] for k in trained) > max(sharded.backward_s[k] for k in frozen) == 0


def test_a_trained_block_is_not_costed_as_a_frozen_twin_that_passes_gradients_through(tmp_path):
    """A trained embedding below the frozen blocks: they pass its gradient back (an input
    gradient, no weight gradient), so their ops ran a backward as the trained blocks' do, and the
    trained blocks took the first frozen one's solution at TP 2, its time without their weight
    gradients (4.0e-5 s where they cost 5.0e-5). They cost what the same blocks cost in the model
    that trains every block."""
    middle, everything = tmp_path / "middle.py", tmp_path / "everything.py"
    middle.write_text(PREFIX.replace("        self.emb.requires_grad_(False)\n", ""))
    everything.write_text(PREFIX.replace("        self.emb.requires_grad_(False)\n", "").replace(
        "        for block in self.blocks[:3]:\n            block.requires_grad_(False)\n", ""))
    costs = {path.name: FrontTable(CompileOptions(model=path, **A100)).chain_costs(micro_batch_size=2, tp=2, dtype="fp32")
             for path in (middle, everything)}
    trained = range(4, 7)
    for k in trained:
        assert costs["middle.py"].forward_s[k] == pytest.approx(costs["everything.py"].forward_s[k], rel=1e-12), k
        assert costs["middle.py"].backward_s[k] == pytest.approx(costs["everything.py"].backward_s[k], rel=1e-12), k
    assert all(costs["middle.py"].weight_s[k] == 0 for k in range(1, 4))


@pytest.mark.parametrize("stage_layers, gradient", [((2, 4), False), ((4, 2), True)], ids=["frozen-cut", "trained-cut"])
def test_the_search_times_a_cut_as_the_plan_it_makes_does(prefix, stage_layers, gradient):
    """Two stages cut inside the frozen prefix (no gradient comes back over the cut) or after it:
    the search's simulated pipeline of those cuts is the plan's own timeline, and the cutter's
    time of the stage after the cut holds the gradient it sends back only where one crosses.
    The search charged a gradient message at every cut: its pipeline of a cut in the frozen
    prefix was the plan's and that message more."""
    import autopart
    from autopart.ir.plan import gradient_boundaries
    from autopart.predict.timeline import plan_timeline
    from autopart.solve.planner import cluster_of
    from autopart.solve.search import Layout, SearchSpace, score_layout
    from autopart.solve.simulated import pipeline_s, simulated_stage_costs

    pins = dict(pp=2, microbatches=4, global_batch_size=8, schedule="1f1b", measure=False)
    plan = autopart.compile(prefix, stage_layers=stage_layers, **pins)
    assert gradient_boundaries(plan.stages) == (gradient,)
    options = CompileOptions(model=prefix, **pins)
    table, cluster = FrontTable(options), cluster_of(options)
    micro_batch_size = plan.schedule.micro_batch_size
    cut = plan.stages[0].blocks[1]
    layout = Layout(pp=2, tp=1, dp=1, micro_batch_size=micro_batch_size, microbatches=4, schedule="1f1b")
    scored = score_layout(layout, table, cluster, SearchSpace(world_size=2, global_batch_size=8),
                          recompute=(("none",), ("none",)), cuts=(cut,))
    searched = pipeline_s("1f1b", 2, 4, 1, simulated_stage_costs(scored, table, cluster))
    assert searched == pytest.approx(plan_timeline(plan).step_s, rel=1e-9)
    after = plan.stages[1]
    assert scored.cut.stage_time_s[1] == pytest.approx(after.forward_s + after.backward_s
                                                       + gradient * plan.predicted.transfer_s[0], rel=1e-9)
    assert table.chain_costs(micro_batch_size=micro_batch_size, tp=1, dtype="fp32").boundary_gradients[cut] is gradient
