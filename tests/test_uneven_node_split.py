"""A group whose ranks lie unevenly on the nodes (8 ranks on nodes of 6: 6 + 2) crosses between
them at the NICs of the node holding the fewest (`cost_models.comm.fewest_members`): the plan's
step was once priced as if it split 4 + 4, about twice the bandwidth its 2 NICs give."""

from pathlib import Path

import pytest

import autopart
from autopart.options import CompileOptions
from cost_models.comm import NodeSpan

GPT3_LAYER = Path(__file__).resolve().parents[1] / "benchmarks" / "models" / "gpt3_layer.py"


def test_the_options_give_the_fewest_members_of_a_group_on_one_node() -> None:
    tp8 = dict(model=GPT3_LAYER, tp=8, pp=1, dp=1, device="h100-sxm")
    assert [CompileOptions(**tp8, gpus_per_node=g).tensor_parallel_span for g in (8, 6, 4, 2)] == [
        NodeSpan(nodes=1, fewest=8), NodeSpan(nodes=2, fewest=2), NodeSpan(nodes=2, fewest=4), NodeSpan(nodes=4, fewest=2)]
    dp12 = dict(model=GPT3_LAYER, tp=1, pp=1, dp=12, device="h100-sxm")  # 8 replicas on one node, 4 on the next
    assert CompileOptions(**dp12, gpus_per_node=8).data_parallel_span == NodeSpan(nodes=2, fewest=4)


def test_tensor_parallelism_split_six_and_two_is_priced_at_the_two_nics() -> None:
    steps = {g: autopart.compile(GPT3_LAYER, device="h100-sxm", dtype="bf16", tp=8, pp=1, dp=1, global_batch_size=8,
                                 microbatches=1, gpus_per_node=g).predicted.step_s
             for g in (6, 4, 2)}
    # 6 + 2 crosses at 2 NICs, as 4 nodes of 2 do, not at the 4 of 4 + 4
    assert steps[6] > 1.3 * steps[4]
    assert steps[6] == pytest.approx(steps[2], rel=0.05)
