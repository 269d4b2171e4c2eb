"""The search's lazy order (``autopart.solve.layout_bounds``): layouts come out in the order of
their exact bound, costed only when an early bound lets them be needed; the early bound never
exceeds the exact one; and the search finds the same result with it as without it."""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from pathlib import Path

import pytest

from autopart.options import CompileOptions
from autopart.solve import search as search_module
from autopart.solve.chain_costs import ChainCosts
from autopart.solve.layout_bounds import early_bound, layout_bound, lazy_order, mesh_overhead_bytes, optimistic_costs
from autopart.solve.planner import FrontTable
from autopart.solve.search import SearchSpace, search
from autopart.solve.tensor import fastest_compute_s, shard_chain
from tests.synthetic_chains import SyntheticTable, cluster, random_table

TINY_GPT = Path(__file__).parent / "models" / "tiny_gpt.py"


def reference_order(items, exact, cutoff):
    """What the search did before: every exact bound first, sorted, then a walk to the cutoff."""
    for bound, item in sorted((exact(item), item) for item in items):
        limit = cutoff()
        if limit is not None and bound >= limit:
            return
        yield bound, item


@pytest.mark.parametrize("seed", range(30))
def test_the_lazy_order_is_the_sorted_order_and_stops_where_it_did(seed):
    rng = random.Random(seed)
    items = list(range(rng.randrange(1, 60)))
    exact = {i: float(rng.randrange(0, 12)) for i in items}  # ties on purpose
    early = {i: exact[i] - rng.choice([0.0, 0.0, rng.uniform(0, 5), math.inf]) for i in items}
    stop_after = rng.randrange(1, len(items) + 2)

    def walk(order):
        seen = []
        cutoff_now = [None]
        for bound, item in order(lambda: cutoff_now[0]):
            seen.append((bound, item))
            if len(seen) == stop_after:  # as the search does once it has its finalists: a cutoff appears
                cutoff_now[0] = bound + rng.choice([0.0, 1.0, 2.5])
        return seen

    rng_state = rng.getstate()
    expected = walk(lambda cutoff: reference_order(items, exact.__getitem__, cutoff))
    rng.setstate(rng_state)
    asked = []

    def costed(i):
        asked.append(i)
        return exact[i]

    got = walk(lambda cutoff: lazy_order(items, exact=costed, early=early.__getitem__, cutoff=cutoff))
    assert got == expected
    if len(expected) < len(items) and expected:  # stopped early: what was left need not all be costed
        assert set(asked) >= {i for _, i in expected}


def test_the_lazy_order_costs_only_what_may_come_out():
    items = list(range(10))
    asked = []
    order = lazy_order(items, exact=lambda i: asked.append(i) or float(i), early=lambda i: float(i) - 0.5,
                       cutoff=lambda: 3.0)
    assert [item for _, item in order] == [0, 1, 2]
    assert sorted(asked) == [0, 1, 2, 3]  # 3's early bound was below the cutoff; 4's was not


def test_an_early_bound_above_the_exact_one_is_caught():
    with pytest.raises(AssertionError, match="early bound"):
        list(lazy_order([1], exact=lambda i: 1.0, early=lambda i: 1.5, cutoff=lambda: None))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlowedTable:
    """A table whose true costs are its optimistic ones slowed block by block (the collectives
    that a sharding adds) and whose parameters are held whole or split: the shape of the real one."""

    base: SyntheticTable
    seed: int
    embedding_all_weight: bool  # the first block's backward all weight gradient, as an embedding's

    def optimistic_costs(self, *, micro_batch_size: int, tp: int, dtype: str) -> ChainCosts:
        costs = self.base.chain_costs(micro_batch_size=micro_batch_size, tp=tp, dtype=dtype)
        if self.embedding_all_weight:
            weight = (costs.backward_s[0], *costs.weight_s[1:])
            costs = costs.changed(weight_s=weight)
        return costs

    def chain_costs(self, *, micro_batch_size: int, tp: int, dtype: str) -> ChainCosts:
        costs = self.optimistic_costs(micro_batch_size=micro_batch_size, tp=tp, dtype=dtype)
        if tp == 1:
            return costs
        rng = random.Random(hash((self.seed, micro_batch_size, tp)))
        slow = [rng.choice([1.0, rng.uniform(1.0, 1.6)]) for _ in range(len(costs))]
        if rng.random() < 0.5:  # only the first block slowed, and much: where weight gradients are all
            slow = [rng.uniform(1.0, 30.0), *(1.0,) * (len(costs) - 1)]  # of a block, its time lowers zb-h1's bound
        whole = {p: b * (tp if rng.random() < 0.3 else 1) for p, b in costs.parameter_bytes.items()}
        return costs.changed(
            forward_s=tuple(f * s for f, s in zip(costs.forward_s, slow)),
            backward_s=tuple(b * s for b, s in zip(costs.backward_s, slow)),
            weight_s=tuple(w * s for w, s in zip(costs.weight_s, slow)),
            parameter_bytes=whole, parameter_state_bytes=dict(whole))

    def state_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32", layered: bool = False,
                    frozen: bool = False) -> int:
        return self.base.state_bytes(parameter_bytes, dp=dp, zero=zero, dtype=dtype, layered=layered, frozen=frozen)

    def owned_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32", frozen: bool = False) -> int:
        return self.base.owned_bytes(parameter_bytes, dp=dp, zero=zero, dtype=dtype, frozen=frozen)


class Exact:
    """The same table without ``optimistic_costs``: every layout costed before the walk."""

    def __init__(self, table):
        self.chain_costs, self.state_bytes, self.owned_bytes = table.chain_costs, table.state_bytes, table.owned_bytes


@pytest.mark.parametrize("seed", range(25))
def test_the_early_bound_never_exceeds_the_exact_one(seed):
    rng = random.Random(seed)
    table = SlowedTable(base=random_table(rng, layers=rng.randrange(1, 5)), seed=seed,
                        embedding_all_weight=rng.random() < 0.6)
    devices = search_module._memoised(cluster(memory_bytes=1 << 40, gpus_per_node=rng.choice([2, 4, 8])))
    space = SearchSpace(world_size=rng.choice([4, 8, 12, 16]), global_batch_size=rng.choice([8, 16, 24, 48]),
                        gpus_per_node=devices.gpus_per_node)
    early = early_bound(table, devices)
    layouts = list(space.layouts(len(table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32"))))
    assert layouts
    finite = 0
    for layout in layouts:
        exact = layout_bound(table, layout, devices)
        bound = early(layout)
        assert bound <= exact, layout
        finite += bound > -math.inf
    assert finite  # the bound is not vacuous


@pytest.mark.parametrize("seed", range(20))
def test_the_search_finds_the_same_with_the_early_bound_as_without(seed):
    rng = random.Random(seed)
    table = SlowedTable(base=random_table(rng, layers=rng.randrange(1, 5)), seed=seed,
                        embedding_all_weight=rng.random() < 0.5)
    base = table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32")
    whole = 4 * sum(base.parameter_bytes.values()) + 16 * sum(base.saved_bytes)
    devices = cluster(memory_bytes=int(whole * rng.uniform(0.1, 1.2)), gpus_per_node=rng.choice([2, 4, 8]))
    space = SearchSpace(world_size=rng.choice([4, 8, 16]), global_batch_size=rng.choice([8, 16, 32]),
                        gpus_per_node=devices.gpus_per_node)
    lazy = search(space, table, devices)
    eager = search(space, Exact(table), devices)
    assert lazy.ranked == eager.ranked
    assert (lazy.layouts, lazy.scored, lazy.fitting, lazy.bound_s) == (eager.layouts, eager.scored, eager.fitting,
                                                                        eager.bound_s)


def test_optimistic_costs_scale_blocks_to_their_floors():
    costs = random_table(random.Random(3), layers=2, tied=False).chain_costs(micro_batch_size=2, tp=1, dtype="fp32")
    floors = [(f + b) / 4 for f, b in zip(costs.forward_s, costs.backward_s)]
    low = optimistic_costs(costs, floors, 4)
    assert [f + b for f, b in zip(low.forward_s, low.backward_s)] == pytest.approx(floors)
    assert [w / (f + b) for f, b, w in zip(low.forward_s, low.backward_s, low.weight_s)] == pytest.approx(
        [w / (f + b) for f, b, w in zip(costs.forward_s, costs.backward_s, costs.weight_s)])
    assert low.parameter_bytes == {p: b // 4 for p, b in costs.parameter_bytes.items()}
    with pytest.raises(ValueError, match="floors"):
        optimistic_costs(costs, floors[1:], 4)


@pytest.mark.parametrize("tp", [2, 4])
def test_no_sharding_of_a_real_chain_beats_its_floor(tp):
    options = CompileOptions(model=TINY_GPT, tp=tp, global_batch_size=8, world_size=tp)
    table = FrontTable(options)
    front = table.annotated_front(micro_batch_size=2, tp=tp, dtype="fp32")
    floors = fastest_compute_s(front.chain, t=tp, cost_model=front.cost_model)
    solved = shard_chain(front.chain, tp=tp, cost_model=front.cost_model)
    assert all(floor <= s.time_s * (1 + 1e-12) for floor, s in zip(floors, solved))
    assert sum(floors) < sum(b.forward_s + b.backward_s for b in front.chain.blocks)  # it does divide
    exact = table.chain_costs(micro_batch_size=2, tp=tp, dtype="fp32")
    low = table.optimistic_costs(micro_batch_size=2, tp=tp, dtype="fp32")
    assert all(a <= b * (1 + 1e-12) for a, b in zip(low.prefix("compute_s"), exact.prefix("compute_s")))
    assert all(low.parameter_bytes[p] <= exact.parameter_bytes[p] for p in exact.parameter_bytes)
    # sequence parallelism (on by default) holds and sends the residual stream's slice: no floor below it
    whole = table.chain_costs(micro_batch_size=2, tp=1, dtype="fp32").boundary_bytes
    assert any(e < w for e, w in zip(exact.boundary_bytes, whole))
    assert all(a <= b for a, b in zip(low.boundary_bytes, exact.boundary_bytes))


def test_state_kept_under_a_key_is_the_state_computed_anew():
    costs = random_table(random.Random(5), layers=3, tied=True).chain_costs(micro_batch_size=2, tp=2, dtype="fp32")
    first = costs.with_state(lambda nbytes: 3 * nbytes, key=(4, False))
    assert costs.with_state(lambda nbytes: 3 * nbytes, key=(4, False)) is first  # kept: layouts share it
    fresh = costs.with_state(lambda nbytes: 3 * nbytes)
    assert first.parameter_state_bytes == fresh.parameter_state_bytes
    assert first.prefix("owned_state_bytes") == fresh.prefix("owned_state_bytes")
    other = costs.with_state(lambda nbytes: nbytes, key=(4, True))
    assert other.parameter_state_bytes == {p: b for p, b in costs.parameter_bytes.items()}


@pytest.mark.parametrize("seed", range(30))
def test_the_exact_bound_is_below_the_estimate_of_every_cut_set(seed):
    """The walk stops at the first layout whose bound passes the finalists, so no cut set of a
    layout may be estimated faster than its bound: here with links slow enough that transfers
    rival the blocks, both ways of hiding the all-reduce, and layers that are FSDP units."""
    rng = random.Random(seed)
    base = random_table(rng, layers=rng.randrange(1, 5))
    table = dataclasses.replace(base, layered=rng.random() < 0.5, boundary_bytes=rng.choice([1, 40, 400]))
    blocks = len(table.forward_s)
    if rng.random() < 0.5:  # a fine-tune: some parameters frozen, which nothing reduces nor steps
        table = dataclasses.replace(table, frozen=frozenset(f"w{k}" for k in range(blocks) if rng.random() < 0.7))
    if rng.random() < 0.5:  # a frozen prefix: no gradient crosses back over its boundaries
        table = dataclasses.replace(table, frozen_prefix=rng.randrange(1, blocks))
    costs = table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32")
    whole = 4 * sum(costs.parameter_bytes.values()) + 8 * sum(costs.saved_bytes)  # memory from scarce to ample:
    memory = int(whole * rng.choice([0.05, 0.2, 0.5, 1e6]))  # an infinite bound must mean that no cuts fit
    devices = dataclasses.replace(cluster(memory_bytes=memory, gpus_per_node=rng.choice([1, 2, 4]),
                                          bandwidth=rng.choice([20.0, 1000.0]), across=rng.choice([10.0, 100.0])),
                                  reduction_overlaps=rng.random() < 0.5)
    space = SearchSpace(world_size=rng.choice([2, 4, 6, 8]), global_batch_size=rng.choice([4, 8, 12]),
                        gpus_per_node=devices.gpus_per_node)
    blocks = len(table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32"))
    checked = 0
    for layout in space.layouts(blocks):
        bound = layout_bound(table, layout, devices)
        cut_sets = {tuple(sorted(rng.sample(range(blocks - 1), layout.stages - 1))) for _ in range(6)}
        for cuts in cut_sets:
            scored = search_module.score_layout(layout, table, devices, space, cuts=cuts)
            if scored is not None:
                assert bound <= scored.estimate_s, (layout, cuts)
                checked += 1
        searched = search_module.score_layout(layout, table, devices, space)
        if searched is not None:  # the refinement's bound is asked on the mesh's cluster, its overhead counted
            mesh = dataclasses.replace(devices, overhead_bytes=mesh_overhead_bytes(
                layout, table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype="fp32"), devices))
            assert bound <= search_module._refine_bound(table, layout, mesh, searched.cut) <= searched.estimate_s
    assert checked or memory < whole


def test_a_layout_whose_ranks_cannot_hold_the_microbatches_in_flight_is_bounded_at_infinity():
    """Sixteen microbatches through four 1F1B stages: the second stage holds three in flight,
    each at least its input (a 4,000-byte boundary) under any recompute, which leaves no room
    under 12,000 bytes whatever the cuts; the parameters alone would fit."""
    table = SyntheticTable(forward_s=(0.1,) + (1.0,) * 8 + (0.5,), saved_bytes=(10_000,) * 10, parameter_bytes=(10,) * 10,
                           boundary_bytes=4_000)
    space = SearchSpace(world_size=4, global_batch_size=16, gpus_per_node=4, pp=(4,), micro_batch_size=(1,),
                        schedule=("1f1b",))
    (layout,) = space.layouts(10)
    for memory, fits in [(11_000, False), (60_000, True)]:
        devices = dataclasses.replace(cluster(memory_bytes=memory, gpus_per_node=4), overhead_bytes=0)
        bound = layout_bound(table, layout, devices)
        assert math.isinf(bound) is not fits
        assert (search_module.score_layout(layout, table, devices, space) is not None) is fits


def test_the_stage_floor_counts_the_transfers_and_the_fewest_blocks_a_stage_holds():
    """Five blocks of a second on two stages: some stage holds three (3 s, with one transfer);
    four on two with transfers of half a second: 4 s of compute and two transfers over two
    stages. Both are the best cuts' slowest stage exactly."""
    from autopart.solve.chain_costs import stage_floor_s

    def chain(blocks):
        return ChainCosts(forward_s=(1 / 3,) * blocks, backward_s=(2 / 3,) * blocks, weight_s=(1 / 3,) * blocks,
                          saved_bytes=(0,) * blocks, selective_saved_bytes=(0,) * blocks,
                          selective_recompute_s=(0.0,) * blocks, boundary_bytes=(1,) * (blocks - 1), input_bytes=0,
                          parameter_bytes={}, parameter_state_bytes={}, block_parameters=((),) * blocks)

    assert stage_floor_s(chain(5), 2) == pytest.approx(3.0)
    assert stage_floor_s(chain(4), 2, 0.5) == pytest.approx(2.5)
    assert stage_floor_s(chain(6), 3, 0.25) == pytest.approx(7 / 3)  # a floor: the best cuts' middle stage takes 2.5 s
    assert stage_floor_s(chain(4), 1, 0.5) == pytest.approx(4.0)  # one stage sends nothing


@pytest.mark.parametrize("seed", range(6))
def test_the_state_total_is_what_the_costs_with_that_state_sum_to(seed):
    """The bound's parameter test reads the chain's whole state without building the costs with it."""
    rng = random.Random(seed)
    table = dataclasses.replace(random_table(rng, layers=rng.randrange(1, 5), tied=seed % 2 == 0), layered=seed < 3)
    costs = table.chain_costs(micro_batch_size=2, tp=rng.choice([1, 2]), dtype="fp32")
    for dp, zero in [(1, 0), (4, 1), (4, 2), (8, 3)]:
        state = functools.partial(table.state_bytes, dp=dp, zero=zero)
        assert costs.state_bytes_total(state) == costs.with_state(state).prefix("owned_state_bytes")[-1]


@pytest.mark.parametrize("seed", range(10))
def test_fsdp_s_collectives_bound_every_cut_set_and_spare_the_search_its_slow_layouts(seed, monkeypatch):
    """FSDP reduce-scatters a stage's gradients after every microbatch's backward (ZeRO-2) and
    gathers its layers for every forward and backward (ZeRO-3): on slow data-parallel links that
    is most of the step, and the bound that counts it (``fully_sharded_floor_s``) lets the search
    pass over layouts it can tell are slow. Never above an estimate; the search finds the same
    plans with it as without it, cutting fewer layouts."""
    from autopart.solve import layout_bounds
    from autopart.solve.data_parallel_tail import fully_sharded_floor_s

    rng = random.Random(seed)
    table = dataclasses.replace(random_table(rng, layers=rng.randrange(2, 7)), layered=True)
    devices = dataclasses.replace(cluster(memory_bytes=1 << 40, gpus_per_node=rng.choice([1, 2]),
                                          bandwidth=rng.choice([0.05, 1.0, 1000.0]), across=rng.choice([0.02, 10.0]),
                                          latency_s=rng.choice([0.0, 1e-3])),
                                  reduction_overlaps=rng.random() < 0.5)
    space = SearchSpace(world_size=rng.choice([4, 8]), global_batch_size=rng.choice([8, 16, 32]),
                        gpus_per_node=devices.gpus_per_node, zero=(1, 2, 3))
    blocks = len(table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32"))
    raised = []
    for layout in space.layouts(blocks):
        costs = table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype="fp32")
        floor = fully_sharded_floor_s(layout, costs, devices)
        bound = layout_bound(table, layout, devices)
        assert floor == 0 or (layout.zero in (2, 3) and layout.dp > 1 and bound >= floor * (1 - 1e-12))
        even = tuple(round(blocks * (s + 1) / layout.stages) - 1 for s in range(layout.stages - 1))
        for cuts in {even, *(tuple(sorted(rng.sample(range(blocks - 1), layout.stages - 1))) for _ in range(8))}:
            scored = search_module.score_layout(layout, table, devices, space, cuts=cuts)
            if scored is not None:
                assert bound <= scored.estimate_s, (layout, cuts)
        searched = search_module.score_layout(layout, table, devices, space)
        assert searched is None or bound <= searched.estimate_s, layout
        with monkeypatch.context() as patch:
            patch.setattr(layout_bounds, "fully_sharded_floor_s", lambda *args: 0.0)
            raised.append((layout.zero, layout_bound(table, layout, devices) < bound))
    assert {2, 3} <= {zero for zero, higher in raised if higher}
    found = search(space, table, devices)
    with monkeypatch.context() as patch:
        patch.setattr(layout_bounds, "fully_sharded_floor_s", lambda *args: 0.0)
        unbounded = search(space, table, devices)
    assert found.ranked == unbounded.ranked and found.scored <= unbounded.scored


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
@pytest.mark.parametrize(("zero", "overlaps"), [(2, False), (2, True), (3, False), (3, True)])
def test_the_fsdp_bound_is_close_where_its_collectives_are_most_of_the_step(zero, overlaps, schedule):
    """Even layers, many microbatches, the collectives as long as the compute that may hide them
    (overlapped ZeRO-3) or longer than any compute: the search's estimate is within a few percent
    of ``fully_sharded_floor_s``, so a floor set too high shows; ZeRO-3 within what the floor sets
    aside for how cuts round a stage's layers (half a layer a stage, four layers to a stage here)
    and, overlapped, within a half more: the floor takes a stage's gathers to hide wholly behind
    its compute and its reduce-scatters not to hold back its later gathers (they do, a unit at a time)."""
    from autopart.solve.data_parallel_tail import fully_sharded_floor_s
    from tests.synthetic_chains import SyntheticTable

    layers = 16  # 8 to a stage, each a unit of 20,000 bytes whose gather and reduce-scatter take 10,000 s each
    compute = 160_000 / 48 if zero == 3 and overlaps else 1e-6  # 48 forwards: a stage's forward and backward
    table = SyntheticTable(forward_s=(1e-6, *(compute,) * (2 * layers), 1e-6), saved_bytes=(1,) * (2 * layers + 2),
                           parameter_bytes=(1, *(10_000,) * (2 * layers), 1), boundary_bytes=1, layered=True)
    devices = dataclasses.replace(cluster(memory_bytes=1 << 40, gpus_per_node=1, bandwidth=1.0, across=1.0,
                                          latency_s=0.0), reduction_overlaps=overlaps)
    space = SearchSpace(world_size=4, global_batch_size=64, gpus_per_node=1, pp=(2,), tp=(1,), zero=(zero,),
                        micro_batch_size=(1,), schedule=(schedule,), chunks=(2,) if schedule == "interleaved" else None)
    (layout,) = [layout for layout in space.layouts(2 * layers + 2) if layout.zero == zero]
    costs = table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32")
    floor = fully_sharded_floor_s(layout, costs, devices)
    bound = layout_bound(table, layout, devices)
    searched = search_module.score_layout(layout, table, devices, space)
    within = {(3, True): 1.65, (3, False): 1.25}.get((zero, overlaps), 1.15)  # ZeRO-3: half a layer a stage
    assert floor <= bound <= searched.estimate_s <= within * floor, searched.estimate_s / floor
