"""ZeRO-3's collectives beside the compute (``autopart.predict.fully_sharded``): FSDP2 gathers a
layer while the one before computes and reduce-scatters a layer's gradients while the next
backward runs, so on a GPU only the first gather and what a layer's transfers run past its
compute hold the stage up; on a CPU every collective adds. The plan's step model, the search's
closed form and its simulator all take that from the one function."""

import random
from dataclasses import replace
import pytest

from autopart.driver import CompileOptions, compile_plan
from autopart.predict.data_parallel import data_parallel_comm
from autopart.predict.fully_sharded import FullyShardedCost, Piece, fully_sharded_cost, slowed
from autopart.predict.step_time import fully_sharded_pieces
from autopart.solve.chain_costs import ChainCosts
from autopart.solve.data_parallel_tail import fully_sharded_extra_s, stage_layers
from cost_models.comm import NodeSpan
from tests.distributed import REPO


def per_byte(seconds_per_byte: float):
    return lambda nbytes: nbytes * seconds_per_byte


def cost(pieces, root_bytes=0.0, *, gather=1.0, reduce=1.0, overlapped=True, slowdown=0.0) -> FullyShardedCost:
    return fully_sharded_cost(pieces, root_bytes, gather_s=per_byte(gather), reduce_s=per_byte(reduce),
                              overlapped=overlapped, slowdown=slowdown)


def brute_force(pieces, root_bytes, gather, reduce, slowdown=0.0) -> tuple[float, float, float]:
    """The same timeline walked one unit at a time, written from FSDP2's order of events: a
    unit's all-gather is issued as the unit before it starts computing, its reduce-scatter as its
    own backward ends, all on one channel in the order issued; while the channel is busy the
    compute runs at 1 / (1 + slowdown) of its speed."""
    def walk(segments):  # (compute, gather before, reduce after)
        channel = ready = segments[0][1]
        compute = 0.0
        for k, (seconds, _, reduced) in enumerate(segments):
            start = max(compute, ready)
            channel = max(channel, start)
            if k + 1 < len(segments) and segments[k + 1][1]:
                channel += segments[k + 1][1]
                ready = channel
            else:
                ready = start
            busy = channel - start  # the channel works from the unit's start until then
            compute = start + (seconds * (1 + slowdown) if busy >= seconds * (1 + slowdown)
                               else busy + (seconds - busy / (1 + slowdown)))
            if reduced:
                channel = max(channel, compute) + reduced
        return compute, max(compute, channel)

    forward = [(0.0, root_bytes * gather, 0.0)] + [(p.forward_s, p.unit_bytes * gather, 0.0) for p in pieces]
    backward = ([(0.0, root_bytes * gather, 0.0)]
                + [(p.backward_s, p.unit_bytes * gather, p.unit_bytes * reduce) for p in reversed(pieces)]
                + [(0.0, 0.0, root_bytes * reduce)])
    forward_end, _ = walk(forward)
    backward_end, channel_end = walk(backward)
    return (forward_end - sum(p.forward_s for p in pieces), backward_end - sum(p.backward_s for p in pieces),
            channel_end - backward_end)


def test_a_layer_s_gather_hides_behind_the_layer_before_where_the_compute_is_longer():
    layers = [Piece(forward_s=3.0, backward_s=6.0, unit_bytes=2.0)] * 10  # gather 2 s, compute 3 s and 6 s
    found = cost(layers, root_bytes=1.0)
    assert found.forward_s == pytest.approx(1.0 + 2.0)  # the root's gather and the first layer's
    # backward: the root's and the first layer's gathers; each later gather and reduce-scatter (4 s) hides
    # behind a 6 s backward; the last layer's reduce-scatter and the root's are left running as it ends
    assert found.backward_s == pytest.approx(1.0 + 2.0)
    assert found.pending_s == pytest.approx(2.0 + 1.0)
    # what stays running goes beside the next action: past a 1 s one, 2 s of it hold that action up
    assert found.backward_beside(1.0) == pytest.approx(3.0 + 2.0)
    assert found.backward_beside(30.0) == pytest.approx(3.0)


def test_where_a_layer_s_transfers_outlast_its_compute_each_adds_its_excess():
    layers = [Piece(forward_s=1.0, backward_s=2.0, unit_bytes=2.0)] * 10  # gather 2 s, gather + reduce 4 s
    found = cost(layers)
    assert found.forward_s == pytest.approx(2.0 + 9 * (2.0 - 1.0))
    # the channel sets the pace from the third layer on: the second's gather, issued as the first
    # starts, goes before the first's reduce-scatter and is done as the first ends
    assert found.backward_s == pytest.approx(2.0 + 8 * (4.0 - 2.0))


def test_on_a_cpu_every_collective_adds_whole():
    layers = [Piece(forward_s=3.0, backward_s=6.0, unit_bytes=2.0)] * 4
    found = cost(layers, root_bytes=1.0, reduce=0.5, overlapped=False)
    assert (found.forward_s, found.backward_s, found.pending_s) == pytest.approx((1 + 8, 1 + 8 + 0.5 + 4, 0.0))


def test_compute_beside_a_collective_runs_slower_while_it_runs():
    assert slowed(1.0, 0.0, 0.25) == 1.0 and slowed(1.0, 0.5, 0.0) == 1.0
    assert slowed(1.0, 0.5, 0.25) == pytest.approx(0.5 + (1.0 - 0.5 / 1.25))  # half a second at 80%, then alone
    assert slowed(1.0, 5.0, 0.25) == pytest.approx(1.25)  # beside it throughout


def test_a_layer_computing_beside_the_next_layer_s_gather_is_slowed_by_it():
    two = [Piece(forward_s=0.2, backward_s=0.4, unit_bytes=0.1)] * 2  # gathers of 0.1 s
    assert cost(two).forward_s == pytest.approx(0.1)  # the first gather
    # and the first layer's first 0.1 s at 80%, beside the second layer's gather
    assert cost(two, slowdown=0.25).forward_s == pytest.approx(0.1 + 0.1 * 0.25 / 1.25)
    # reduce-scatters left running slow the next action as long as they run beside it
    found = cost(two, slowdown=0.25)
    assert found.pending_s > 0
    assert found.backward_beside(10.0) == pytest.approx(found.backward_s + found.pending_s * 0.25 / 1.25)
    assert found.backward_beside(0.0) == pytest.approx(found.backward_s + found.pending_s)


@pytest.mark.parametrize("seed", range(40))
def test_the_steady_state_shortcut_gives_the_walk_one_unit_at_a_time(seed):
    """Runs of equal layers are advanced at once once they shift the state evenly; mixed runs,
    root pieces between them and every balance of compute against transfers included."""
    rng = random.Random(seed)
    pieces, counted = [], []
    for _ in range(rng.randint(1, 5)):
        piece, count = Piece(forward_s=rng.uniform(0, 3), backward_s=rng.uniform(0, 6),
                             unit_bytes=rng.choice([0.0, rng.uniform(0.1, 4)])), rng.randint(1, 30)
        pieces += [piece] * count
        counted.append(replace(piece, count=count))
    root, gather, reduce = rng.choice([0.0, rng.uniform(0, 5)]), rng.uniform(0.1, 2), rng.uniform(0.1, 2)
    slowdown = rng.choice([0.0, rng.uniform(0, 0.5)])
    walked = brute_force(pieces, root, gather, reduce, slowdown)
    for given in (pieces, counted):
        found = cost(given, root, gather=gather, reduce=reduce, slowdown=slowdown)
        assert (found.forward_s, found.backward_s, found.pending_s) == pytest.approx(walked, rel=1e-9, abs=1e-9)


class LinearCluster:
    """The search's view of a GPU cluster whose collectives take a second per GB."""
    reduction_overlaps = True

    def __init__(self, slowdown: float):
        self.overlap_slowdown = slowdown

    def all_gather_s(self, nbytes, group, span):
        return nbytes / 1e9


class LinearModel:
    """The step model's cost model of the same links."""
    def collective_time(self, kind, nbytes, group, *, nodes=1, members=None):
        return nbytes / 1e9


@pytest.mark.parametrize("slowdown", [0.0, 0.19, 0.5])
def test_the_step_model_charges_a_stage_its_unhidden_transfers_and_the_search_the_same(slowdown):
    """``data_parallel_comm`` (the plan's) and ``fully_sharded_extra_s`` (the search's) on one
    stage of four equal layers: the same seconds, and less than the whole gathers on a GPU."""
    layers, layer_bytes, forward = 4, 1e9, 0.8
    pieces = (Piece(forward_s=forward / layers, backward_s=2 * forward / layers, unit_bytes=layer_bytes / layers),) * layers
    counted = Piece(forward_s=forward / layers, backward_s=2 * forward / layers, unit_bytes=layer_bytes / layers,
                    count=layers)
    plan = data_parallel_comm(3, 1.5e9, dp=8, nodes=8, cost_model=LinearModel(), overlapped=True, slowdown=slowdown,
                              hidden_behind_s=forward, pieces=pieces)
    search = fully_sharded_extra_s(3, LinearCluster(slowdown), 1.5e9, forward, dp=8,
                                   dp_span=NodeSpan(nodes=8, fewest=1), dtype="fp32", layers=(int(layer_bytes), layers))
    assert (plan.forward_s, plan.backward_s) == pytest.approx(search)
    assert data_parallel_comm(3, 1.5e9, dp=8, nodes=8, cost_model=LinearModel(), overlapped=True, slowdown=slowdown,
                              hidden_behind_s=forward, pieces=(counted,)) == plan  # four equal layers, as one piece
    whole = data_parallel_comm(3, 1.5e9, dp=8, nodes=8, cost_model=LinearModel(), overlapped=True, slowdown=slowdown,
                               hidden_behind_s=forward)
    # the root's gather and the first layer's; each later layer's 0.25 s gather runs beside the 0.2 s
    # forward before it, which goes at 1 / (1 + slowdown) of its speed meanwhile: the layer waits for
    # the gather or for its slowed predecessor, whichever ends later
    beside = 0.2 + min(0.25, 0.2 * (1 + slowdown)) * slowdown / (1 + slowdown)
    assert plan.forward_s == pytest.approx(0.5 + 0.25 + 3 * (max(0.25, beside) - 0.2))
    assert (beside > 0.25) == (slowdown == 0.5)  # the compute sets the pace at the largest slowdown
    assert whole.forward_s == pytest.approx(1.5)
    assert plan.backward_s < whole.backward_s


@pytest.mark.parametrize("slowdown", [0.0, 0.5])
def test_zero_2_s_reduce_scatter_slows_the_next_forward_in_the_plan_and_the_search_alike(slowdown):
    for forward, scatter in ((1.0, 0.4), (0.2, 0.4)):  # the reduce-scatter hidden, or running past the forward
        plan = data_parallel_comm(2, scatter * 1e9, dp=8, nodes=1, cost_model=LinearModel(), overlapped=True,
                                  slowdown=slowdown, hidden_behind_s=forward)
        search = fully_sharded_extra_s(2, LinearCluster(slowdown), scatter * 1e9, forward, dp=8,
                                       dp_span=NodeSpan(nodes=1, fewest=8), dtype="fp32")
        assert plan.backward_s == pytest.approx(search[1])
        ran_past = scatter - forward
        slowed_by = min(scatter, forward * (1 + slowdown)) * slowdown / (1 + slowdown)
        assert plan.backward_s == pytest.approx(max(0.0, ran_past, slowed_by))
    assert plan.backward_s > 0  # 0.4 s beside a 0.2 s forward: it runs past it


def test_a_plan_s_stage_pieces_are_its_blocks_with_each_whole_layer_one_unit():
    options = CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, dp=2, zero=3, microbatches=2,
                             micro_batch_size=2, schedule="1f1b", optimizer="adamw")  # fmt: skip
    plan, front = compile_plan(options)
    parameter_bytes = front.chain.parameter_bytes
    for stage, pieces in zip(plan.stages, fully_sharded_pieces(front, plan.stages, options.tp)):
        units = [p for p in pieces if p.unit_bytes]
        held = set(stage.parameters)
        layers = sorted(k for k in {name.split(".")[1] for name in held if name.startswith("h.")}
                        if all(p in held for p in parameter_bytes if p.startswith(f"h.{k}.")))
        assert len(units) == len(layers) > 0  # a layer split by the cut stays in the root unit, as the runtime runs it
        for layer, unit in zip(layers, units):
            assert unit.unit_bytes == sum(b for p, b in parameter_bytes.items() if p.startswith(f"h.{layer}."))
        assert sum(p.forward_s for p in pieces) == pytest.approx(stage.forward_s)
        assert sum(p.backward_s for p in pieces) == pytest.approx(stage.backward_s)
        assert sum(p.unit_bytes for p in pieces) < stage.parameter_bytes  # the embedding and head are the root's


def test_the_search_counts_each_stage_s_layers_from_the_chain():
    names = (("wte",), ("h.0.w",), ("h.0.v", "h.1.w"), ("h.1.v",), ("h.2.w", "h.2.v"), ("head",))
    nbytes = {"wte": 100, "head": 100} | {f"h.{k}.{x}": 20 for k in range(3) for x in "wv"}
    n = len(names)
    costs = ChainCosts(forward_s=(1.0,) * n, backward_s=(2.0,) * n, weight_s=(1.0,) * n, saved_bytes=(0,) * n,
                       selective_saved_bytes=(0,) * n, selective_recompute_s=(0.0,) * n, boundary_bytes=(8,) * (n - 1),
                       input_bytes=8, parameter_bytes=nbytes, parameter_state_bytes=nbytes, block_parameters=names,
                       layer_parameters=frozenset(p for p in nbytes if p.startswith("h.")), layer_bytes=40)
    assert stage_layers(costs, (2,)) == ((60, 2), (60, 2))  # a layer cut in two counts as one each side
    assert stage_layers(costs, (0, 3)) == ((0, 0), (80, 2), (40, 1))
