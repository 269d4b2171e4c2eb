"""The simulated step of a scored layout (``autopart.solve.simulated``) against the closed form
the search ranks by, and against the search's lower bound."""

from __future__ import annotations

import dataclasses
import random

import pytest

from autopart.schedule import StageCosts, add_communication, build_schedule, simulate
from autopart.solve.search import Cluster, Layout, SearchSpace, score_layout, search
from autopart.solve.simulated import pipeline_s, simulated_stage_costs, simulated_step_s
from cost_models.comm import NodeSpan
from tests.synthetic_chains import SyntheticTable, cluster, random_table


def no_transfer(memory_bytes: int = 10**12, gpus_per_node: int = 8) -> Cluster:
    """A cluster whose point-to-point messages take no time (collectives and optimizer still do)."""
    return dataclasses.replace(cluster(memory_bytes=memory_bytes, gpus_per_node=gpus_per_node),
                               p2p_s=lambda nbytes, across: 0.0)


def equal_table(blocks: int) -> SyntheticTable:
    """Every block costs the same: any cut into equal numbers of blocks gives equal stages."""
    return SyntheticTable(forward_s=(1.0,) * blocks, saved_bytes=(100,) * blocks, parameter_bytes=(500,) * blocks,
                          boundary_bytes=10)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, microbatches, dp", [(1, 4, 2), (2, 4, 1), (4, 8, 2), (4, 3, 1), (8, 16, 4)])
@pytest.mark.parametrize("mode", ["none", "selective", "full", "stage"])
def test_equal_stages_simulate_to_the_closed_form(schedule, pp, microbatches, dp, mode) -> None:
    blocks = 16
    table = equal_table(blocks)
    layout = Layout(pp=pp, tp=1, dp=dp, micro_batch_size=2, microbatches=microbatches, schedule=schedule,
                    zero=dp > 1)
    space = SearchSpace(world_size=layout.world_size, global_batch_size=2 * microbatches * dp)
    cuts = tuple(blocks // pp * (s + 1) - 1 for s in range(pp - 1))
    devices = no_transfer()
    scored = score_layout(layout, table, devices, space, recompute=((mode,),) * pp, cuts=cuts)
    assert scored is not None and set(scored.recompute) == {mode}
    assert simulated_step_s(scored, table, devices) == pytest.approx(scored.estimate_s, rel=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_the_simulated_step_is_never_below_the_search_lower_bound(seed: int) -> None:
    rng = random.Random(seed)
    table = random_table(rng, layers=rng.randint(2, 5))
    gpus_per_node = rng.choice([1, 2, 4, 8])
    devices = cluster(memory_bytes=10**9, gpus_per_node=gpus_per_node, latency_s=rng.choice([0.0, 1e-3, 0.1]))
    space = SearchSpace(world_size=rng.choice([2, 4, 8]), global_batch_size=rng.choice([8, 16, 32]),
                        gpus_per_node=gpus_per_node)
    result = search(space, table, devices, finalists=12)
    assert result.ranked
    for scored in result.ranked:
        assert simulated_step_s(scored, table, devices) >= result.bound_s
    # Not each layout's own bound (``layout_bound``): that bounds the closed form, which the
    # simulator beats on unequal stages (below); over 150 seeds of this test a finalist's
    # simulated step fell to 0.981x its layout's bound (1f1b) and 0.987x (interleaved, 2 chunks).


def test_1f1b_hides_the_later_stages_behind_the_warmup_where_the_closed_form_adds_them() -> None:
    # stage 0 takes 3 s a microbatch, stage 1 0.3 s: while rank 0 runs its warm-up forward,
    # microbatch 0 goes through stage 1 and back, so the step is m x 3 s, not 3.3 + (m - 1) x 3.
    table = SyntheticTable(forward_s=(1.0, 0.1), saved_bytes=(100, 100), parameter_bytes=(500, 500),
                           boundary_bytes=10)
    layout = Layout(pp=2, tp=1, dp=1, micro_batch_size=1, microbatches=4, schedule="1f1b")
    devices = no_transfer()
    scored = score_layout(layout, table, devices, SearchSpace(world_size=2, global_batch_size=4),
                          recompute=(("none",), ("none",)), cuts=(0,))
    tail = devices.optimizer_s_per_byte * 500
    assert scored.estimate_s == pytest.approx(3.3 + 3 * 3.0 + tail)
    assert simulated_step_s(scored, table, devices) == pytest.approx(4 * 3.0 + tail)


@pytest.mark.parametrize("pp, microbatches", [(2, 2), (2, 8), (3, 6), (4, 4), (4, 16), (8, 8), (8, 32)])
@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("forward, backward", [(1.0, 2.0), (1.0, 3.0)])
def test_interleaved_equal_stages_simulate_to_the_closed_form(pp, microbatches, chunks, forward, backward) -> None:
    # Measured: exact (to rounding) for every case here; Megatron's order has no bubble beyond
    # (p - 1) / v of a rank's microbatch time when the virtual stages are equal.
    stages = pp * chunks
    costs = StageCosts.uniform(stages, forward_s=forward / chunks, backward_s=backward / chunks, weight_s=0.0)
    per_rank = forward + backward
    closed = microbatches * per_rank + (pp - 1) * per_rank / chunks
    assert pipeline_s("interleaved", pp, microbatches, chunks, costs) == pytest.approx(closed, rel=1e-9)


@pytest.mark.parametrize("pp, microbatches", [(2, 2), (2, 8), (3, 6), (4, 4), (4, 16), (8, 8), (8, 32)])
def test_zb_h1_equal_stages_match_the_closed_form_while_w_is_no_longer_than_f(pp, microbatches) -> None:
    # The closed form's cool-down (p - 1)(F + I - W) holds while W <= F; with W = 1.5 F it is
    # optimistic, by at most 9% over these cases (measured: 1.0897 at pp=8, m=8; it shrinks as m grows).
    closed = {}
    for forward, backward, weight in [(1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (1.0, 3.0, 1.5)]:
        costs = StageCosts.uniform(pp, forward_s=forward, backward_s=backward, weight_s=weight)
        formula = (pp + microbatches - 1) * (forward + backward) - 2 * (pp - 1) * weight
        closed[weight <= forward] = pipeline_s("zb-h1", pp, microbatches, 1, costs) / formula
    assert closed[True] == pytest.approx(1.0, rel=1e-9)
    assert 1.0 <= closed[False] <= 1.09


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("gpipe", 1)])
def test_lowering_the_schedule_changes_no_time(schedule, chunks) -> None:
    # pipeline_s simulates the compute-only schedule; the compiler simulates the lowered one.
    rng = random.Random(7)
    pp, microbatches = 4, 8
    stages = pp * chunks
    forward = tuple(rng.uniform(0.5, 2.0) for _ in range(stages))
    costs = StageCosts(forward_s=forward, backward_s=tuple(2 * f for f in forward), weight_s=forward,
                       transfer_s=tuple(rng.uniform(0.0, 0.5) for _ in range(stages - 1)))
    lowered = add_communication(build_schedule(schedule, ranks=pp, microbatches=microbatches, chunks=chunks), ranks=pp)
    assert pipeline_s(schedule, pp, microbatches, chunks, costs) == simulate(lowered, costs, ranks=pp).step_s


def test_stage_costs_sum_the_blocks_and_add_the_recompute_and_the_transfer() -> None:
    table = SyntheticTable(forward_s=(0.1, 1.0, 2.0, 3.0, 0.5), saved_bytes=(100,) * 5, parameter_bytes=(500,) * 5,
                           boundary_bytes=10)
    layout = Layout(pp=2, tp=1, dp=1, micro_batch_size=1, microbatches=4, schedule="1f1b")
    space = SearchSpace(world_size=2, global_batch_size=4, gpus_per_node=1)
    devices = cluster(memory_bytes=10**9, gpus_per_node=1, across=10.0, latency_s=0.0)
    scored = score_layout(layout, table, devices, space, recompute=(("selective",), ("full",)), cuts=(1,))
    costs = simulated_stage_costs(scored, table, devices)
    # synthetic backward = 2 forward, weight = forward, selective repeats a quarter of the forward;
    # full repeats the one layer stage 1 holds whole (block 3; block 2 ends a layer the cut split, 4 is the head)
    assert table.layer_spans() == ((1, 3), (3, 4))
    assert costs.forward_s == pytest.approx((1.1, 5.5))
    assert costs.backward_s == pytest.approx((2.2 + 1.1 / 4, 11.0 + 3.0))
    assert costs.weight_s == pytest.approx((1.1, 5.5))
    assert costs.transfer_s == pytest.approx((1.0,))  # 10 bytes over 10 bytes/s across nodes


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("pp, chunks", [(2, 2), (2, 4), (4, 2), (4, 4)])
def test_interleaved_estimate_keeps_up_with_the_simulator_on_the_cuts_it_chooses(seed, pp, chunks) -> None:
    # The cuts are refined by the estimate, which used to count only the busiest rank's sum and
    # so let the chunks on a rank drift apart: the simulator then ran them up to 1.44x slower
    # (measured over 400 such cases; 1.12x at the median with 4 chunks). Over the same cases the
    # estimate now is at most 1.11x optimistic, 0.96x at the median (down to 0.76x on uneven chains).
    rng = random.Random(seed)
    table = random_table(rng, layers=rng.randint(2 * chunks, 12))
    microbatches = pp * rng.choice([1, 2, 4])
    gpus_per_node = rng.choice([1, 8])
    devices = cluster(memory_bytes=10**9, gpus_per_node=gpus_per_node, latency_s=rng.choice([0.0, 1e-3, 0.1]))
    layout = Layout(pp=pp, tp=1, dp=1, micro_batch_size=1, microbatches=microbatches, schedule="interleaved",
                    chunks=chunks)
    space = SearchSpace(world_size=pp, global_batch_size=microbatches, gpus_per_node=gpus_per_node)
    scored = score_layout(layout, table, devices, space)
    assert scored is not None
    assert simulated_step_s(scored, table, devices) <= 1.12 * scored.estimate_s


def overlapping(latency_s: float = 0.0) -> Cluster:
    """No point-to-point time; all-reduces slow enough (1 byte/s over 2 replicas: a block's 500
    bytes take 500 s) to be what the step waits for, run beside the compute."""
    return dataclasses.replace(cluster(memory_bytes=10**12, gpus_per_node=8, bandwidth=1.0, latency_s=latency_s),
                               p2p_s=lambda nbytes, across: 0.0, reduction_overlaps=True)


def test_one_stage_reduces_beside_its_last_backward_and_its_first_block_after_it() -> None:
    table, devices = equal_table(4), overlapping()
    layout = Layout(pp=1, tp=1, dp=2, micro_batch_size=1, microbatches=2, schedule="1f1b")
    scored = score_layout(layout, table, devices, SearchSpace(world_size=2, global_batch_size=4),
                          recompute=(("none",),), cuts=())
    costs = simulated_stage_costs(scored, table, devices)
    end = pipeline_s("1f1b", 1, 2, 1, costs)
    last_backward_starts = end - costs.backward_s[0]
    # blocks 1-3's 1500 bytes from the start of the last backward, block 0's 500 after its end
    done = max(last_backward_starts + 1500.0, end) + 500.0
    assert simulated_step_s(scored, table, devices) == pytest.approx(done + devices.optimizer_s_per_byte * 2000)


@pytest.mark.parametrize("chunks", [2, 4])
def test_interleaved_chunks_reduce_beside_the_cool_down_of_their_rank(chunks: int) -> None:
    # a rank's deepest chunk finishes its backward first; its all-reduce runs beside the rest of
    # the cool-down, which the closed form (the last microbatch's backward only) does not count
    table, devices = equal_table(16), overlapping()
    layout = Layout(pp=2, tp=1, dp=2, micro_batch_size=1, microbatches=4, schedule="interleaved", chunks=chunks)
    space = SearchSpace(world_size=4, global_batch_size=8)
    cuts = tuple(16 // (2 * chunks) * (s + 1) - 1 for s in range(2 * chunks - 1))
    scored = score_layout(layout, table, devices, space, recompute=(("none",),) * (2 * chunks), cuts=cuts)
    costs = simulated_stage_costs(scored, table, devices)
    pipeline = pipeline_s("interleaved", 2, 4, chunks, costs)
    update = devices.optimizer_s_per_byte * 4000
    simulated = simulated_step_s(scored, table, devices)
    assert pipeline + update < simulated < scored.estimate_s
    # each rank reduces 8 blocks' 4000 bytes: at most all of it after the pipeline, at least what
    # its last-finishing stage holds beyond its own last backward
    assert simulated <= pipeline + 4000.0 + update


@pytest.mark.parametrize("zero, gathers", [(1, 1), (3, 2 * 2)])
def test_the_gathers_in_bf16_move_bf16_weights(zero: int, gathers: int) -> None:
    # the distributed optimizer's owners broadcast bf16 weights after the step (ZeRO-1); FSDP
    # casts its fp32 shards to bf16 before it gathers them before every forward and backward
    # (ZeRO-3: two microbatches): half the bytes of fp32's gathers
    table, devices = equal_table(4), overlapping()
    space = SearchSpace(world_size=2, global_batch_size=4)
    steps = {}
    for dtype in ("fp32", "bf16"):
        layout = Layout(pp=1, tp=1, dp=2, micro_batch_size=1, microbatches=2, schedule="1f1b", zero=zero, dtype=dtype)
        scored = score_layout(layout, table, devices, space, recompute=(("none",),), cuts=())
        steps[dtype] = simulated_step_s(scored, table, devices)
    gather, inside = devices.all_gather_s, NodeSpan(nodes=1, fewest=2)
    assert steps["fp32"] - steps["bf16"] == pytest.approx(gathers * (gather(2000, 2, inside) - gather(1000, 2, inside)))
