"""The search times a pipeline boundary as the plan's step model does (`autopart.solve.transfers`,
`autopart.predict.messages`): under tensor parallelism without sequence parallelism each rank
sends its 1/t of the replicated residual stream and the receivers all-gather it; with it, each
sends its slice. The search once timed the whole tensor over the pipeline link."""

from pathlib import Path

import pytest

import autopart
from autopart.options import CompileOptions
from autopart.solve.planner import FrontTable, cluster_of
from autopart.solve.search import Layout
from autopart.solve.transfers import boundary_transfer_s
from cost_models.comm import NodeSpan

TINY_GPT = Path(__file__).parent / "models" / "tiny_gpt.py"
PINS = dict(pp=2, tp=2, dp=1, micro_batch_size=2, microbatches=4, schedule="1f1b", device="a100-80gb",
            gpus_per_node=2)  # two nodes: the pipeline crosses them, each TP group stays inside one


@pytest.mark.parametrize("sp", [False, True])
def test_the_search_times_a_boundary_as_the_plan_does(sp):
    plan = autopart.compile(TINY_GPT, sp=sp, **PINS)
    assert plan.sp is sp
    options = CompileOptions(model=TINY_GPT, sp=sp, **PINS)
    costs = FrontTable(options).chain_costs(micro_batch_size=2, tp=2, dtype="fp32")
    layout = Layout(pp=2, tp=2, dp=1, micro_batch_size=2, microbatches=4, schedule="1f1b")
    cluster = cluster_of(options)
    cut = plan.stages[0].blocks[1]
    searched = boundary_transfer_s(costs, layout, cluster)[cut]
    assert searched == pytest.approx(plan.predicted.transfer_s[0], rel=1e-9)
    whole = cluster.p2p_s(costs.boundary_bytes[cut], True)
    if sp:  # the slice goes as it is held: nothing to gather
        assert not any(costs.boundary_gathered_bytes) and searched == pytest.approx(whole)
    else:  # half over the pipeline link, then an all-gather inside the node (here, tiny, slower than the whole)
        held = costs.boundary_bytes[cut]
        assert costs.boundary_gathered_bytes[cut] == held > 0
        inside = NodeSpan(nodes=1, fewest=2)
        assert searched == pytest.approx(cluster.p2p_s(held // 2, True) + cluster.all_gather_s(held, 2, inside))
        assert searched != pytest.approx(whole)


def test_a_boundary_s_time_kept_with_the_costs_is_the_one_each_layout_and_cluster_would_get_afresh():
    """Kept per what it reads (the degree, whether the pipeline crosses nodes, the TP group's
    nodes, the links): asked of one costs object for layouts and clusters that differ in each,
    every answer is the one a fresh copy of the costs gives."""
    import dataclasses

    options = CompileOptions(model=TINY_GPT, sp=False, **PINS)
    costs = FrontTable(options).chain_costs(micro_batch_size=2, tp=2, dtype="fp32")
    within, across = cluster_of(options), cluster_of(dataclasses.replace(options, gpus_per_node=8))
    slower = dataclasses.replace(within, p2p_s=lambda nbytes, crossing: 2 * within.p2p_s(nbytes, crossing))
    asked = []
    for cluster in (within, across, slower, within):
        for pp, tp in ((2, 2), (4, 2), (2, 1), (1, 4)):
            layout = Layout(pp=pp, tp=tp, dp=1, micro_batch_size=2, microbatches=4, schedule="1f1b")
            kept = boundary_transfer_s(costs, layout, cluster)
            assert kept == boundary_transfer_s(costs.changed(), layout, cluster)
            asked.append(kept)
    assert len(set(asked)) > 4  # the answers differ: the keys matter
