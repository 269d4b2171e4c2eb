"""The search's data-parallel choices: the ZeRO level, the all-reduce hidden behind the backward
as the step model hides it, and sequence parallelism where activations fit only with it."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

import autopart
from autopart.ir.errors import InfeasibleError
from autopart.predict.memory import state_bytes
from autopart.schedule import SPLIT_BACKWARD_KINDS
from autopart.solve.data_parallel_tail import fsdp_may_pay, tail_s
from autopart.solve.search import Layout, SearchSpace, score_layout, search
from cost_models.comm import NodeSpan
from tests.synthetic_chains import SyntheticTable, cluster, random_table

ONE_NODE = NodeSpan(nodes=1, fewest=4)  # the data-parallel group of four on one node

REPO = Path(__file__).resolve().parent.parent


def test_fsdp_levels_never_meet_a_split_backward() -> None:
    default = list(SearchSpace(world_size=8, global_batch_size=16, gpus_per_node=8).layouts(12))
    assert {layout.zero for layout in default if layout.dp > 1} == {0, 1, 2, 3}
    assert all(layout.zero == 0 for layout in default if layout.dp == 1)
    assert any(layout.schedule in SPLIT_BACKWARD_KINDS for layout in default)
    for layout in default:  # the runtime refuses FSDP with a split backward (`check_level`)
        assert not (layout.zero in (2, 3) and layout.schedule in SPLIT_BACKWARD_KINDS), layout
    pinned = list(SearchSpace(world_size=8, global_batch_size=16, gpus_per_node=8, zero=(0, 1)).layouts(12))
    assert {layout.zero for layout in pinned} == {0, 1}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_zero_2_peaks_hold_at_least_zero_1s_so_the_search_skips_them_where_it_does_not_fit(optimizer) -> None:
    """What the search's pruning rests on: at every size and group, level 2 holds at its peak at
    least what level 1 holds (``autopart.predict.memory``: the stage is its FSDP unit), and so does
    level 3 outside the repeated layers; a layer's own unit holds its shards alone, less."""
    for nbytes in (4, 1000, 12_345_678, 7 << 30):
        for dp in (2, 3, 8, 64):
            one = state_bytes(nbytes, optimizer=optimizer, dp=dp, zero=1)
            assert state_bytes(nbytes, optimizer=optimizer, dp=dp, zero=2) >= one
            assert state_bytes(nbytes, optimizer=optimizer, dp=dp, zero=3) >= one
            assert state_bytes(nbytes, optimizer=optimizer, dp=dp, zero=2, layered=True) >= one
            if nbytes >= 1000:
                assert state_bytes(nbytes, optimizer=optimizer, dp=dp, zero=3, layered=True) < one


def test_the_search_takes_zero_3_where_only_its_per_layer_units_fit() -> None:
    """An embedding, four layers of two 1,000-byte blocks, a head, over dp = 4 with fp32 AdamW:
    ZeRO-1 holds 2 x 10,000 + 20,000/4 = 25,000 bytes; ZeRO-3 the embedding's and head's whole
    weights and gradients and all shards (2 x 2,000 + 40,000/4 = 14,000) and two 2,000-byte layers
    in flight, weights and gradients (8,000): 22,000."""
    table = SyntheticTable(forward_s=(0.1, *(1.0,) * 8, 0.5), saved_bytes=(1,) * 10, parameter_bytes=(1000,) * 10,
                           boundary_bytes=1, layered=True)
    devices = cluster(memory_bytes=23_500, gpus_per_node=8)  # 470 bytes of overhead
    space = SearchSpace(world_size=4, global_batch_size=4, gpus_per_node=8, pp=(1,), tp=(1,))
    best = search(space, table, devices).best
    assert best.layout.dp == 4 and best.layout.zero == 3
    assert best.cut.stage_memory_bytes == (14_000 + 10,)  # and one microbatch's activations, 1 byte a block
    assert best.cut.rank_memory_bytes == (14_010 + 8_000 + 470,)  # the layers in flight are the rank's
    assert search(dataclasses.replace(space, zero=(0, 1, 2)), table, devices).ranked == ()
    assert search(space, dataclasses.replace(table, layered=False), devices).ranked == (), "one unit: 2P whole"


def layout(**changes) -> Layout:
    return dataclasses.replace(Layout(pp=1, tp=1, dp=4, micro_batch_size=1, microbatches=4, schedule="1f1b"),
                               **changes)


def test_the_all_reduce_adds_only_what_runs_past_the_last_backward_where_collectives_overlap() -> None:
    devices = cluster(memory_bytes=1 << 30, gpus_per_node=8, bandwidth=1000.0, latency_s=0.0,
                      optimizer_s_per_byte=1e-4)
    overlapping = dataclasses.replace(devices, reduction_overlaps=True)
    nbytes = 8000  # all-reduce over 4: 2 * 3/4 * 8000 / 1000 = 12 s; the optimizer step 0.8 s
    step, reduce = 0.8, 12.0
    assert tail_s(layout(), devices, [nbytes], ONE_NODE, [20.0]) == pytest.approx(reduce + step)  # a CPU: it adds
    assert tail_s(layout(), overlapping, [nbytes], ONE_NODE, [20.0]) == pytest.approx(step)  # hidden whole
    assert tail_s(layout(), overlapping, [nbytes], ONE_NODE, [5.0]) == pytest.approx(reduce - 5.0 + step)
    assert tail_s(layout(), overlapping, [nbytes], ONE_NODE) == pytest.approx(reduce + step)  # nothing to hide behind
    # ZeRO-1: a quarter of the step, then the updated shards gathered (6 s), which nothing hides
    assert tail_s(layout(zero=1), overlapping, [nbytes], ONE_NODE, [20.0]) == pytest.approx(step / 4 + 6.0)
    # bf16 ZeRO-1: the distributed optimizer gathers bf16 weights, half the bytes (3 s)
    assert tail_s(layout(zero=1, dtype="bf16"), overlapping, [nbytes], ONE_NODE, [20.0]) == pytest.approx(step / 4 + 3.0)
    # ZeRO-2: the step waits for the last reduce-scatter (6 s) and gathers once (6 s)
    assert tail_s(layout(zero=2), overlapping, [nbytes], ONE_NODE, [20.0]) == pytest.approx(step / 4 + 12.0)


def test_the_estimate_hides_the_all_reduce_behind_the_backward_on_overlapping_devices() -> None:
    table = random_table(random.Random(5), layers=2)
    devices = cluster(memory_bytes=1 << 40, gpus_per_node=8, bandwidth=50.0, latency_s=0.0)
    space = SearchSpace(world_size=4, global_batch_size=4, gpus_per_node=8)
    plain = score_layout(layout(), table, devices, space)
    hidden = score_layout(layout(), table, dataclasses.replace(devices, reduction_overlaps=True), space, cuts=(),
                          recompute=plain.cut.recompute and ((plain.cut.recompute[0],),))
    costs = table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32")
    reduce = devices.all_reduce_s(sum(costs.parameter_bytes.values()), 4, ONE_NODE)
    backward = 2 / 3 * plain.cut.stage_time_s[0]
    assert plain.estimate_s - hidden.estimate_s == pytest.approx(min(reduce, backward))


def test_the_search_takes_zero_1_not_3_where_zero_1_fits_and_is_faster() -> None:
    """ZeRO-3 gathers the weights before each forward and backward; ZeRO-1 steps whole tensors,
    so its slowest replica steps more than an even share: an optimizer step short beside the
    gathers (as an accelerator's is) leaves ZeRO-1 the faster."""
    table = random_table(random.Random(11), layers=3)
    costs = table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32")
    roomy = cluster(memory_bytes=100 * 4 * sum(costs.parameter_bytes.values()), gpus_per_node=1, bandwidth=20.0,
                    latency_s=1e-3, optimizer_s_per_byte=1e-7)
    space = SearchSpace(world_size=4, global_batch_size=8, gpus_per_node=1, pp=(1,), zero=(1, 3))
    best = search(space, table, roomy).best
    assert best.layout.dp == 4 and best.layout.zero == 1
    level_3 = score_layout(dataclasses.replace(best.layout, zero=3), table, roomy, space)
    assert level_3 is not None and level_3.estimate_s > best.estimate_s  # it fits too; its gathers cost


def test_the_search_shards_the_optimizer_state_where_nothing_else_fits() -> None:
    """A data-parallel cluster whose memory holds the weights and gradients but not the whole
    optimizer state: only ZeRO-1 fits (ZeRO-2 holds more at its peak, ``autopart.predict.memory``)."""
    table = SyntheticTable(forward_s=(0.1, 1.0, 1.0, 0.5), saved_bytes=(1, 1, 1, 1), parameter_bytes=(1000,) * 4,
                           boundary_bytes=1)
    # 4000 parameter bytes: 16,000 whole, 10,000 at ZeRO-1, 12,000 at ZeRO-2's peak; 220 bytes overhead
    devices = cluster(memory_bytes=11_000, gpus_per_node=8)
    space = SearchSpace(world_size=4, global_batch_size=4, gpus_per_node=8, pp=(1,), tp=(1,))
    best = search(space, table, devices).best
    assert best.layout.dp == 4 and best.layout.zero == 1
    assert search(dataclasses.replace(space, zero=(0, 2)), table, devices).ranked == ()


MEGATRON_LAYERS = '''
import sys
sys.path.insert(0, {models!r})
import megatron_layers as m
m.LAYERS, m.SIZE_OF_NORMED, m.SPLIT_QKV = 2, False, False
from megatron_layers import build_model, init_weights, example_batch, loss_fn
'''


def test_the_search_takes_sequence_parallelism_where_activations_fit_only_with_it(tmp_path) -> None:
    """Korthikanti et al.'s layers at t = 2: sequence parallelism stores the norms' and dropouts'
    activations split in two. With the memory between the two layouts' peaks, the search finds
    the plan with it, and pinned off it finds none (one replica per device holds more still)."""
    model = tmp_path / "layers.py"
    model.write_text(MEGATRON_LAYERS.format(models=str(REPO / "tests" / "models")))
    pinned = dict(pp=1, recompute="none", device="h100-sxm")
    peaks = {sp: max(autopart.compile(model, tp=2, dp=1, sp=sp, microbatches=1, micro_batch_size=1,
                                      **pinned).predicted.memory_bytes) for sp in (True, False)}
    assert peaks[True] < peaks[False]
    memory = (peaks[True] + peaks[False]) / 2
    searched = dict(world_size=2, global_batch_size=2, memory_gib=memory / (1 << 30), **pinned)
    plan = autopart.compile(model, **searched)
    assert plan.sp and plan.mesh["tp"] == 2 and max(plan.predicted.memory_bytes) <= memory
    with pytest.raises(InfeasibleError):
        autopart.compile(model, sp=False, **searched)


@pytest.mark.parametrize("seed", range(8))
def test_with_the_overlap_the_bounds_still_prune_nothing_better(seed) -> None:
    """The visit stops when a layout's lower bound passes the finalists: with the all-reduce
    hidden behind the backward the bound must still be below every estimate, so the search's
    best is the best of scoring every layout."""
    rng = random.Random(seed)
    table = random_table(rng, layers=rng.randint(1, 3))
    costs = table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32")
    devices = dataclasses.replace(
        cluster(memory_bytes=int(rng.uniform(0.3, 2.0) * 4 * sum(costs.parameter_bytes.values())) + 4_000,
                gpus_per_node=rng.choice([1, 2, 4]), bandwidth=rng.choice([5.0, 50.0, 1000.0])),
        reduction_overlaps=True)
    space = SearchSpace(world_size=rng.choice([2, 4, 8]), global_batch_size=rng.choice([4, 8]),
                        gpus_per_node=devices.gpus_per_node)
    scored = [score_layout(layout, table, devices, space) for layout in space.layouts(len(costs))]
    every = min((s.estimate_s for s in scored if s is not None), default=None)
    result = search(space, table, devices, finalists=1)
    if every is None:
        assert result.ranked == ()
    else:
        assert result.best.estimate_s <= every * (1 + 1e-9)


@pytest.mark.parametrize("bandwidth, pays", [(1.0, True), (1e6, False)])
def test_zero_2_is_tried_only_where_zero_1s_all_reduce_sticks_out(bandwidth, pays) -> None:
    """ZeRO-2 adds at least a reduce-scatter to the tail where ZeRO-1's all-reduce hides behind
    the backward: the search scores it only where the all-reduce runs past by more than that."""
    table = SyntheticTable(forward_s=(0.1, 1.0, 1.0, 0.5), saved_bytes=(1, 1, 1, 1), parameter_bytes=(400,) * 4,
                           boundary_bytes=1)
    devices = dataclasses.replace(cluster(memory_bytes=1 << 30, gpus_per_node=8, bandwidth=bandwidth, latency_s=0.0),
                                  reduction_overlaps=True)
    space = SearchSpace(world_size=4, global_batch_size=4, gpus_per_node=8, pp=(1,), tp=(1,), micro_batch_size=(1,),
                        zero=(1, 2))
    zero_1 = score_layout(layout(zero=1), table, devices, space)
    assert fsdp_may_pay(zero_1, table, devices) is pays
    result = search(space, table, devices)
    assert result.scored == (2 if pays else 1)
    assert {s.layout.zero for s in result.ranked} == ({1, 2} if pays else {1})
