"""The baselines do what they claim, and autopart's search is no worse than any of them, and as
good as exhaustive search, on small synthetic chains."""

from __future__ import annotations

import itertools
import random

import pytest

from autopart.ir.recompute import RECOMPUTE_MODES

from autopart.ir.errors import ConfigError
from autopart.solve.search import SearchSpace, score_layout, search
from autopart.solve.baseline_search import (
    PARTITIONERS,
    exhaustive_count,
    exhaustive_search,
    grid_search,
    grid_space,
)
from autopart.solve.baselines import (
    equal_layer_cuts,
    layer_units,
    parameter_balanced_cuts,
    pipedream_cuts,
    stage_parameter_bytes,
    uniform_cuts,
)
from autopart.solve.chain_costs import stage_figures
from tests.synthetic_chains import SyntheticTable, cluster, random_table

GPT_LAYERS = [None, None, *(f"h.{k // 2}" for k in range(16)), None, None]  # wte, wpe, 8 layers, ln_f, head


def stages_of(cuts: tuple[int, ...], blocks: int) -> list[range]:
    firsts, lasts = [0, *(c + 1 for c in cuts)], [*cuts, blocks - 1]
    return [range(a, b + 1) for a, b in zip(firsts, lasts)]


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
def test_equal_layers_give_each_stage_its_share_of_layers(stages: int) -> None:
    cuts = equal_layer_cuts(GPT_LAYERS, stages)
    per_stage = [{GPT_LAYERS[k] for k in r} - {None} for r in stages_of(cuts, len(GPT_LAYERS))]
    counts = [len(layers) for layers in per_stage]
    assert sum(counts) == 8 and max(counts) - min(counts) <= 1
    # the embedding opens the first stage and the head closes the last one
    assert cuts == () or (cuts[0] >= 3 and cuts[-1] <= len(GPT_LAYERS) - 4)
    if 8 % stages == 0:
        assert counts == [8 // stages] * stages
    with pytest.raises(ConfigError):
        equal_layer_cuts(GPT_LAYERS, 9)


def test_uniform_counts_the_embedding_and_the_head_as_layers() -> None:
    assert layer_units(GPT_LAYERS)[:2] == [(0, 1), (2, 3)] and layer_units(GPT_LAYERS)[-1] == (18, 19)
    cuts = uniform_cuts(GPT_LAYERS, 5)  # 10 units: embedding, 8 layers, head
    assert stages_of(cuts, 20) == [range(0, 4), range(4, 8), range(8, 12), range(12, 16), range(16, 20)]
    cuts = uniform_cuts(GPT_LAYERS, 4)  # 10 units over 4 stages: 3, 3, 2, 2
    assert [len(r) for r in stages_of(cuts, 20)] == [2 + 4, 6, 4, 2 + 2]


@pytest.mark.parametrize("seed", range(12))
def test_parameter_balance_is_the_smallest_largest_stage_over_layer_boundaries(seed: int) -> None:
    rng = random.Random(seed)
    table = random_table(rng, layers=rng.randint(2, 6))
    costs, layers = table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32"), table.layers
    units = layer_units(layers)
    stages = rng.randint(2, min(4, len(units)))
    cuts = parameter_balanced_cuts(costs, layers, stages)
    boundaries = [b for _, b in units[:-1]]
    assert set(cuts) <= set(boundaries)  # cuts fall between layers

    def largest(cut_set) -> int:
        return max(stage_parameter_bytes(costs, r.start, r.stop - 1) for r in stages_of(cut_set, len(layers)))

    best = min(largest(c) for c in itertools.combinations(boundaries, stages - 1))
    assert largest(cuts) == best
    # within one unit of an even split
    unit_bytes = [stage_parameter_bytes(costs, a, b) for a, b in units]
    assert largest(cuts) <= sum(unit_bytes) / stages + max(unit_bytes)


@pytest.mark.parametrize("seed", range(12))
def test_pipedream_minimises_the_slowest_stage_or_transfer(seed: int) -> None:
    rng = random.Random(100 + seed)
    table = random_table(rng, layers=rng.randint(1, 4))
    costs = table.chain_costs(micro_batch_size=2, tp=1, dtype="fp32")
    blocks = len(costs)
    stages = rng.randint(2, min(5, blocks))
    transfer = tuple(rng.uniform(0.0, 3.0) for _ in range(blocks - 1))
    mode = rng.choice(["none", "selective", "full"])

    def slowest(cut_set) -> float:
        times = [stage_figures(costs, r.start, r.stop - 1, mode=mode, in_flight=1, transfer_in_s=0.0,
                               transfer_out_s=0.0).time_s for r in stages_of(cut_set, blocks)]
        return max(times + [2 * transfer[c] for c in cut_set])

    cuts = pipedream_cuts(costs, stages, transfer_s=transfer, recompute=mode)
    assert len(cuts) == stages - 1
    best = min(slowest(c) for c in itertools.combinations(range(blocks - 1), stages - 1))
    assert slowest(cuts) == pytest.approx(best, rel=1e-12)


def small_case(seed: int):
    rng = random.Random(seed)
    table = random_table(rng, layers=rng.randint(1, 2))
    world, batch = rng.choice([2, 4]), rng.choice([2, 4, 8])
    c0 = table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32")
    total = 4 * sum(c0.parameter_bytes.values()) + batch * sum(c0.saved_bytes)
    devices = cluster(memory_bytes=int(total * rng.uniform(0.2, 1.0)), gpus_per_node=rng.choice([1, 2, 4]),
                      bandwidth=rng.choice([100.0, 1000.0]), across=rng.choice([10.0, 100.0]))
    return table, SearchSpace(world_size=world, global_batch_size=batch, gpus_per_node=devices.gpus_per_node), devices


def test_the_megatron_grid_is_equal_layers_1f1b_and_one_recompute_setting() -> None:
    table, space, devices = small_case(3)
    space = SearchSpace(world_size=4, global_batch_size=8, gpus_per_node=4)
    layers = table.layers
    result = grid_search("megatron", space, table, devices, PARTITIONERS["megatron"], lambda b, t, d: layers)
    assert result.best is not None
    layout, cut = result.best.layout, result.best.cut
    assert layout.schedule == "1f1b" and layout.chunks == 1
    assert len(set(cut.recompute)) == 1
    assert cut.cuts == (equal_layer_cuts(layers, layout.pp) if layout.pp > 1 else ())
    # the best of every grid layout and recompute setting it tried
    grid = list(grid_space(space).layouts(len(layers)))
    # wherever there are replicas, Megatron's distributed optimizer (ZeRO-1) or not, or Megatron-FSDP's
    # ZeRO-2 and 3; the grid's only schedule is 1F1B
    assert {g.zero for g in grid if g.dp > 1} == {0, 1, 2, 3} and {g.zero for g in grid if g.dp == 1} == {0}
    assert {g.schedule for g in grid} == {"1f1b"} and {g.zero for g in grid if g.pp > 1 and g.dp > 1} == {0, 1, 2, 3}
    repeated = len({layer for layer in layers if layer is not None})
    # Megatron recomputes per layer (--recompute-method uniform) or a stage's layers at once (block, all of them)
    assert result.candidates == sum(len(RECOMPUTE_MODES) for g in grid if g.pp <= repeated)
    for g in grid:
        if g.pp > repeated:
            continue
        for mode in RECOMPUTE_MODES:
            cuts = equal_layer_cuts(layers, g.pp) if g.pp > 1 else ()
            other = score_layout(g, table, devices, space, recompute=((mode,),) * g.pp, cuts=cuts)
            assert other is None or other.estimate_s >= result.best.estimate_s


def pipeline_case(seed: int):
    """One device per node and a slow network: data parallelism costs, so pipelines win."""
    rng = random.Random(seed)
    table = random_table(rng, layers=rng.randint(1, 2))
    world, batch = rng.choice([2, 4]), rng.choice([4, 8])
    c0 = table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32")
    total = 4 * sum(c0.parameter_bytes.values()) + batch * sum(c0.saved_bytes)
    devices = cluster(memory_bytes=int(total * rng.uniform(0.3, 0.8)), gpus_per_node=1, bandwidth=1000.0,
                      across=rng.choice([5.0, 20.0]))
    return table, SearchSpace(world_size=world, global_batch_size=batch, gpus_per_node=1), devices


ANY = [s for s in range(40) if exhaustive_count(small_case(s)[1], len(small_case(s)[0].forward_s)) <= 6_000][:3]
CASES = [(small_case, s) for s in ANY] + [(pipeline_case, s) for s in (2, 4, 6, 10, 12)]  # pp 4, 4, 2, 2, 2 x 2 chunks


@pytest.mark.parametrize(("case", "seed"), CASES, ids=[f"{c.__name__}-{s}" for c, s in CASES])
def test_autopart_is_no_worse_than_any_baseline_and_equals_exhaustive(case, seed: int) -> None:
    table, space, devices = case(seed)
    layers = table.layers
    ours = search(space, table, devices)
    exhaustive = exhaustive_search(space, table, devices, limit=40_000)
    assert exhaustive.finished
    if exhaustive.best is None:
        assert not ours.ranked
        return
    assert ours.ranked
    assert ours.best.estimate_s == pytest.approx(exhaustive.step_s, rel=1e-12)
    for name, partition in PARTITIONERS.items():
        baseline = grid_search(name, space, table, devices, partition, lambda b, t, d: layers)
        assert ours.best.estimate_s <= baseline.step_s * (1 + 1e-12), name
    # the estimate autopart reports is the one a baseline would get for the same choices
    again = score_layout(ours.best.layout, table, devices, space, cuts=ours.best.cut.cuts,
                         recompute=tuple((m,) for m in ours.best.recompute))
    assert again is not None and again.estimate_s == pytest.approx(ours.best.estimate_s, rel=1e-12)


def test_a_time_balanced_cut_beats_equal_layers_when_the_head_is_heavy() -> None:
    """Not a tautology of the search: on a chain whose head costs three layers, the grid's equal
    layers leave the last stage slowest, and autopart's step is shorter."""
    forward = (0.05, 1.0, 1.0, *(1.0,) * 12, 6.0)  # emb, 7 layers of 2 blocks, head = 3 layers' work
    table = SyntheticTable(forward_s=forward, saved_bytes=(10,) * 16, parameter_bytes=(100,) * 16,
                           boundary_bytes=1)
    space = SearchSpace(world_size=4, global_batch_size=16, gpus_per_node=4, tp=(1,), dp=(1,))
    devices = cluster(memory_bytes=10**9, gpus_per_node=4)
    ours = search(space, table, devices)
    megatron = grid_search("megatron", space, table, devices, PARTITIONERS["megatron"], lambda b, t, d: table.layers)
    assert megatron.step_s > 1.2 * ours.best.estimate_s
