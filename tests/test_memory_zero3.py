"""The memory model of ZeRO-3 with per-layer FSDP units (``autopart.predict.memory``): a repeated
layer's parameters are held as shards, and each rank holds two layers whole in flight; the
layers the model counts so are the units the runtime makes; and the cut solver, the search and
the plan's prediction take them from the one function."""

from dataclasses import replace

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from autopart.passes.front import build_front
from autopart.predict.memory import LAYERS_IN_FLIGHT, layers_in_flight_bytes, state_bytes
from autopart.runtime.stage import stage_names
from autopart.solve.assemble import layered_parameters, pipeline_problem
from autopart.solve.pipeline import evaluate
from tests.distributed import REPO

PSI = 1_000_000


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_layer_s_own_unit_holds_its_shards_and_two_layers_are_whole_in_flight(dtype):
    fp32 = 4 * PSI
    for dp in (2, 8):
        assert state_bytes(fp32, optimizer="adamw", dp=dp, zero=3, layered=True, dtype=dtype) == 4 * fp32 // dp
        assert state_bytes(fp32, optimizer="adamw", dp=dp, zero=3, dtype=dtype) == 2 * fp32 + 4 * fp32 // dp  # root
        assert state_bytes(fp32, optimizer="adamw", dp=dp, zero=2, layered=True, dtype=dtype) == 2 * fp32 + 4 * fp32 // dp
        # the whole weights and gradients of the layer computing and of the one FSDP gathers next
        assert layers_in_flight_bytes(fp32, dp=dp, zero=3) == LAYERS_IN_FLIGHT * 2 * fp32 == 4 * fp32
        assert layers_in_flight_bytes(fp32, dp=dp, zero=2) == layers_in_flight_bytes(fp32, dp=dp, zero=1) == 0
    assert layers_in_flight_bytes(fp32, dp=1, zero=3) == 0  # one replica: nothing sharded, nothing gathered


def test_the_model_s_layers_are_the_units_the_runtime_makes_and_the_cut_solver_counts_them(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))  # what earlier tests cached moves the cuts
    # three stages, from the CPU's roofline rather than its measured ops: cuts that do not move
    # with the machine, the first inside a layer
    options = CompileOptions(model=REPO / "examples" / "gpt.py", pp=3, dp=2, zero=3, microbatches=3,
                             micro_batch_size=2, schedule="1f1b", optimizer="adamw", measure=False)  # fmt: skip
    front = build_front(options, 2)
    local = dict(front.chain.parameter_bytes)
    layered, layer_bytes = layered_parameters(front.chain, local)
    layers = {name.split(".")[1] for name in layered}
    assert all(name.startswith("h.") for name in layered) and layers == {"0", "1", "2", "3"}
    assert layer_bytes == max(sum(b for p, b in local.items() if p.startswith(f"h.{k}.")) for k in layers)
    plan, _ = compile_to_directory(options, tmp_path / "out")
    def layer(name: str) -> str:
        return ".".join(name.split(".")[:2])

    for stage in plan.stages:  # every layer a stage holds whole is an FSDP unit of its own at run time
        source = (tmp_path / "out" / "stages" / f"stage_{stage.index}.py").read_text()
        held = set(stage_names(tmp_path / "out", stage.index))
        units = {name for name in held if f"'{layer(name)}'" in source.split("layer_methods = ")[1]}
        whole = {name for name in held & layered if all(p in held for p in layered if layer(p) == layer(name))}
        assert units == whole and units  # a layer split by a cut runs inline, in the stage's root unit
    zero3, zero1 = pipeline_problem(options, front, 3), pipeline_problem(replace(options, zero=1), front, 3)
    assert zero3.overhead_bytes - zero1.overhead_bytes == 4 * layer_bytes
    for name, nbytes in local.items():
        assert zero3.parameter_state_bytes[name] == (4 * nbytes // 2 if name in layered else 2 * nbytes + 4 * nbytes // 2)
    # what the plan predicts is the cut solver's own figure, in which a layer the cut splits (it runs
    # in each stage's root unit, whole over the stage's compute) costs what the root's parameters cost
    cuts = tuple(stage.blocks[-1] for stage in plan.stages[:-1])
    split = {name for stage in plan.stages for name in set(stage.parameters) & layered
             if not all(p in stage.parameters for p in layered if layer(p) == layer(name))}
    assert split  # a cut falls inside a layer
    more = [sum(2 * local[p] for p in split & set(stage.parameters)) for stage in plan.stages]  # whole weights and grads
    assert plan.predicted.memory_bytes == evaluate(zero3, cuts).rank_memory_bytes
    unsplit = evaluate(replace(zero3, split_layers=()), cuts).rank_memory_bytes
    assert plan.predicted.memory_bytes == tuple(m + x for m, x in zip(unsplit, more))


def test_the_search_s_cutter_costs_a_layer_its_cut_splits_as_root_parameters():
    """At ZeRO-3 the search's stage figures (``stage_figures``, as its cutters and its memory
    figure take them) cost the part of a layer that a cut splits as the plan does: root
    parameters, whole weights and gradients beside their shards, not a layer unit's shards."""
    from autopart.solve.chain_costs import ChainCosts, stage_figures

    names = (("wte",), ("h.0.a",), ("h.0.b",), ("h.1.a",), ("h.1.b",), ("head",))
    nbytes = {"wte": 4 * PSI, "head": 4 * PSI} | {f"h.{k}.{x}": PSI for k in range(2) for x in "ab"}
    n = len(names)
    costs = ChainCosts(forward_s=(1.0,) * n, backward_s=(2.0,) * n, weight_s=(1.0,) * n, saved_bytes=(0,) * n,
                       selective_saved_bytes=(0,) * n, selective_recompute_s=(0.0,) * n, boundary_bytes=(8,) * (n - 1),
                       input_bytes=8, parameter_bytes=nbytes, parameter_state_bytes=nbytes, block_parameters=names,
                       layer_parameters=frozenset(p for p in nbytes if p.startswith("h.")), layer_bytes=2 * PSI,
                       layer_spans=((1, 3), (3, 5)))
    dp = 4

    def state(size, layered=False):
        return state_bytes(size, optimizer="adamw", dp=dp, zero=3, layered=layered)

    def parameters(costs, first, last):
        return stage_figures(costs, first, last, mode="none", in_flight=1, transfer_in_s=0.0,
                             transfer_out_s=0.0).parts[0]

    zero3 = costs.with_state(state)
    shard, whole = state(PSI, layered=True), state(PSI)
    assert whole > shard
    found = [parameters(zero3, first, last) for first, last in ((0, 2), (1, 4), (2, 3), (3, 5), (2, 2))]
    assert found == [state(4 * PSI) + 2 * shard,  # layer 0 whole in the stage: its unit
                     4 * shard,  # both layers whole
                     2 * whole,  # the second half of layer 0, the first of layer 1: each in the root
                     2 * shard + state(4 * PSI),
                     whole]
    def zero1(size, layered=False):
        return state_bytes(size, optimizer="adamw", dp=dp, zero=1, layered=layered)

    # below ZeRO-3 a layer costs the same wherever it is cut
    assert parameters(costs.with_state(zero1), 2, 3) == 2 * zero1(PSI)
