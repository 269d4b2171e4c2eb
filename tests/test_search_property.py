"""Every plan the search returns is a valid plan, on random small chains and clusters
(hypothesis), and on real compiles of a small GPT."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from autopart.driver import CompileOptions
from autopart.ir.actions import Kind
from autopart.ir.errors import ConfigError
from autopart.ir.owners import largest_share
from autopart.solve.planner import plan_by_search
from autopart.predict.timeline import simulate_pipeline
from autopart.passes.recompute import transient_microbatches
from autopart.schedule import SPLIT_BACKWARD_KINDS, add_communication, build_schedule, stage_placement, validate
from autopart.solve.search import SearchSpace, score_layout, search
from autopart.solve.chain_costs import stage_figures
from cost_models import get_cost_model
from tests.synthetic_chains import cluster, random_table

TINY_GPT = Path(__file__).parent / "models" / "tiny_gpt.py"


def rank_activation_peak(actions: list, parts: list[tuple[int, int, int]]) -> int:
    """The most activation bytes a rank holds at once as it runs its action list in order (a
    forward takes a microbatch in, its backward or weight-gradient half lets it go: the input half
    keeps the graph for it)."""
    live: dict[int, int] = {}
    peak = 0
    for action in actions:
        if action.kind is Kind.F:
            live[action.stage] = live.get(action.stage, 0) + 1
            peak = max(peak, sum(count * parts[s][1] for s, count in live.items()))
        elif action.kind in (Kind.B, Kind.W):
            live[action.stage] -= 1
    return peak


def owners_beyond_shares(table, costs, layout, firsts, lasts, placement, rank: int) -> int:
    """What the rank's ZeRO-1 replica owning most holds beyond the shares (`autopart.ir.owners`): the
    synthetic chains are fp32 with no decayed parameter, so one group of the rank's stages' tensors."""
    if layout.zero != 1 or layout.dp == 1:
        return 0
    sizes = [table.owned_bytes(costs.parameter_bytes[p], dp=layout.dp, zero=1)
             for s, (a, b) in enumerate(zip(firsts, lasts)) if placement[s] == rank
             for p in dict.fromkeys(p for k in range(a, b + 1) for p in costs.block_parameters[k])]
    return largest_share([sizes], layout.dp) - sum(size // layout.dp for size in sizes)


def simulated_in_flight(kind: str, ranks: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    stages = ranks * chunks
    return simulate_pipeline(kind=kind, ranks=ranks, microbatches=microbatches, chunks=chunks,
                             forward_s=(1.0,) * stages, backward_s=(2.0,) * stages, weight_s=(1.0,) * stages,
                             transfer_s=(0.0,) * (stages - 1)).peak_in_flight


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(seed=1, layers=2, world_size=6, gpus_per_node=1, global_batch_size=12, memory=0.1875)  # zb-h1, full recompute
@given(
    seed=st.integers(0, 2**32 - 1),
    layers=st.integers(1, 4),
    world_size=st.sampled_from([1, 2, 3, 4, 6, 8]),
    gpus_per_node=st.sampled_from([1, 2, 4, 8]),
    global_batch_size=st.sampled_from([1, 2, 3, 4, 8, 12, 16]),
    memory=st.floats(0.05, 1.5),
)
def test_every_plan_the_search_returns_is_valid(seed, layers, world_size, gpus_per_node, global_batch_size, memory):
    table = random_table(random.Random(seed), layers=layers)
    base = table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32")
    whole = 4 * sum(base.parameter_bytes.values()) + global_batch_size * sum(base.saved_bytes)
    devices = cluster(memory_bytes=max(1, int(whole * memory)), gpus_per_node=gpus_per_node)
    space = SearchSpace(world_size=world_size, global_batch_size=global_batch_size, gpus_per_node=gpus_per_node)
    try:
        result = search(space, table, devices)
    except ConfigError:  # no layout at all: the batch does not split over any data-parallel degree
        assert not list(space.layouts(len(base)))
        return
    assert result.scored <= result.layouts
    for scored in result.ranked:
        layout, cut = scored.layout, scored.cut
        assert layout.pp * layout.tp * layout.dp == world_size
        assert layout.microbatches * layout.micro_batch_size * layout.dp == global_batch_size
        assert layout.tp <= gpus_per_node  # tensor parallelism stays inside a node
        costs = table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
        blocks = len(costs)
        # each block in exactly one stage, every stage non-empty
        firsts, lasts = [0, *(c + 1 for c in cut.cuts)], [*cut.cuts, blocks - 1]
        assert len(firsts) == layout.stages and all(a <= b for a, b in zip(firsts, lasts))
        assert [k for a, b in zip(firsts, lasts) for k in range(a, b + 1)] == list(range(blocks))
        # memory within the budget on every rank, recomputed here from the reported recompute modes
        state = {p: table.state_bytes(b, dp=layout.dp, zero=layout.zero) for p, b in costs.parameter_bytes.items()}
        held = costs.with_state(lambda nbytes: table.state_bytes(nbytes, dp=layout.dp, zero=layout.zero))
        assert held.parameter_state_bytes == state
        plain = held
        if layout.schedule not in SPLIT_BACKWARD_KINDS:  # a whole backward: full recompute layer by layer
            held = held.checkpointing_layers()
        else:  # a split one: each stage but the first keeps its seeds for W, as long as its recompute's rebuilds
            held = held.splitting_backward()
        flight = simulated_in_flight(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
        # recomputed activations live from a microbatch's backward to its weight gradient (zb-h1's W waits)
        schedule = build_schedule(layout.schedule, ranks=layout.pp, microbatches=layout.microbatches,
                                  chunks=layout.chunks)
        transient = transient_microbatches(schedule, layout.stages)
        placement = stage_placement(layout.schedule, ranks=layout.pp, chunks=layout.chunks)
        transfer = tuple(devices.p2p_s(b, layout.pp * layout.tp > gpus_per_node) for b in costs.boundary_bytes)
        parts = []  # per stage: parameter bytes, bytes per microbatch in flight, bytes held once
        for s, (a, b) in enumerate(zip(firsts, lasts)):
            figures = stage_figures(held, a, b, mode=cut.recompute[s], in_flight=flight[s],
                                    transfer_in_s=transfer[a - 1] if s else 0.0,
                                    transfer_out_s=transfer[b] if s < layout.stages - 1 else 0.0,
                                    transient=transient[s])
            parts.append(figures.parts)
            assert figures.time_s == pytest.approx(cut.stage_time_s[s])
            if layout.schedule in SPLIT_BACKWARD_KINDS:  # the seeds of the microbatches between I and W
                without = stage_figures(plain, a, b, mode=cut.recompute[s], in_flight=flight[s], transfer_in_s=0.0,
                                        transfer_out_s=0.0, transient=transient[s]).parts[2]
                assert figures.parts[2] - without == (transient[s] * sum(costs.weight_seed_bytes[a : b + 1]) if s else 0)
        memory_per_rank = [devices.overhead_bytes + rank_activation_peak(actions, parts)
                           + sum(parts[s][0] + parts[s][2] for s in range(layout.stages) if placement[s] == rank)
                           + owners_beyond_shares(table, costs, layout, firsts, lasts, placement, rank)
                           for rank, actions in sorted(schedule.items())]  # fmt: skip
        assert tuple(memory_per_rank) == cut.rank_memory_bytes
        assert max(memory_per_rank) <= devices.memory_bytes
        # the schedule's action lists validate
        validate(add_communication(schedule, ranks=layout.pp, placement=placement), ranks=layout.pp,
                 stages=layout.stages, microbatches=layout.microbatches, placement=placement)
        # its step is what the same choices get when given (the baselines' way in)
        again = score_layout(layout, table, devices, space, cuts=cut.cuts,
                             recompute=tuple((m,) for m in cut.recompute))
        assert again is not None and again.estimate_s == pytest.approx(scored.estimate_s, rel=1e-12)
    if result.ranked:
        assert result.bound_s <= result.best.estimate_s
        assert [s.step_s for s in result.ranked] == sorted(s.step_s for s in result.ranked)


@pytest.mark.parametrize(("world_size", "global_batch_size", "pins"), [(4, 8, {}), (8, 8, {"tp": 1})])
def test_a_searched_compile_emits_a_valid_plan(world_size: int, global_batch_size: int, pins: dict) -> None:
    # one micro-batch size, so that the front captures the model once or twice (seconds each)
    options = CompileOptions(model=TINY_GPT, world_size=world_size, global_batch_size=global_batch_size,
                             micro_batch_size=1, device="h100-sxm", time_limit_s=5.0, **pins)
    searched = plan_by_search(options, finalists=2)
    plan = searched.plan
    mesh = plan.mesh
    assert mesh["pp"] * mesh["tp"] * mesh["dp"] == world_size
    assert plan.schedule.microbatches * plan.schedule.micro_batch_size * mesh["dp"] == global_batch_size
    assert len(plan.stages) == mesh["pp"] * plan.schedule.chunks
    compute_nodes = [n for block in searched.front.chain.blocks for n in block.nodes]
    in_stages = [n for stage in plan.stages for n in stage.nodes]
    assert sorted(in_stages) == sorted(compute_nodes) and len(set(in_stages)) == len(in_stages)
    placement = stage_placement(plan.schedule.kind, ranks=mesh["pp"], chunks=plan.schedule.chunks)
    assert tuple(stage.rank for stage in plan.stages) == placement
    assert max(plan.predicted.memory_bytes) <= get_cost_model("h100-sxm").device.memory_bytes
    schedule = build_schedule(plan.schedule.kind, ranks=mesh["pp"], microbatches=plan.schedule.microbatches,
                              chunks=plan.schedule.chunks)
    validate(add_communication(schedule, ranks=mesh["pp"], placement=placement), ranks=mesh["pp"],
             stages=len(plan.stages), microbatches=plan.schedule.microbatches, placement=placement)
