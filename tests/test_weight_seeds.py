"""What a split backward keeps from I to W (`autopart.passes.weight_seeds`): the figure the memory
model counts per block is, summed over a stage, the bytes the runtime's own I keeps for the
stage's W, in one process and on each rank of a tensor-parallel group; and the zero-bubble plans
count them, for the microbatches held between I and W, on every stage but the first."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from autopart.codegen.emit import emit_directory
from autopart.driver import CompileOptions, compile_plan
from autopart.ir.model_file import load_model_file
from autopart.passes.front import block_weight_seeds
from autopart.predict.in_flight import transient, weight_pending
from autopart.runtime.backward import backward_input
from autopart.runtime.forward import StageForward
from autopart.runtime.stage import load_stage
from autopart.solve.cut_problem import evaluate
from autopart.solve.assemble import pipeline_problem
from tests.distributed import FREE_LINKS, REPO, run_program

GPT = REPO / "examples" / "gpt.py"
CPU = torch.device("cpu")


def kept_for_weights(outputs, grads, inputs, parameters) -> tuple[int, bool]:
    """The bytes of the gradients I keeps for W, and whether it kept the whole graph instead."""
    _, pending = backward_input(outputs, grads, inputs, parameters)
    kept = {g.untyped_storage()._cdata: g.untyped_storage().nbytes() for group in pending.groups
            for seeds in group.kept.values() for g in seeds if g is not None}  # each storage once
    return sum(kept.values()), pending.whole is not None


def _compiled(tmp_path: Path, **options) -> tuple:
    plan, front = compile_plan(CompileOptions(model=options.pop("model", GPT), schedule="zb-h1", **options))
    return plan, front, emit_directory(plan, front.op_graph, front.spec, tmp_path / "out")


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "bf16-autocast"])
def test_a_stage_keeps_for_its_weight_gradients_what_its_blocks_figures_sum_to(tmp_path, dtype):
    plan, front, out = _compiled(tmp_path, pp=3, microbatches=3, micro_batch_size=2, dtype=dtype)
    seeds = block_weight_seeds(front)
    inputs, target = load_model_file(GPT).example(2)
    batch = dict(zip(plan.graph_inputs, (*inputs, target)))
    torch.manual_seed(0)
    received: list[torch.Tensor] = []
    for stage in plan.stages:
        module = load_stage(out, stage.index, CPU)
        args = [t.detach().requires_grad_(True) for t in received] + [batch[n] for n in stage.batch_inputs]
        forward = StageForward(module, recompute="none", dtype=dtype, device=CPU, split_backward=True)
        forward.begin_step()
        result, _ = forward(*args)
        outputs = list(result) if isinstance(result, tuple) else [result]
        floats = [a for a in args if a.is_floating_point()]
        kept, whole = kept_for_weights(outputs, [torch.randn_like(o) for o in outputs], floats,
                                       list(module.parameters()))
        first, last = stage.blocks
        if stage.index == 0:  # its inputs take no gradient: I keeps the whole graph for W, and no seeds
            assert whole and kept == 0
        else:
            assert not whole and kept == sum(seeds[first : last + 1]) > 0, stage.index
        received = [t.detach() for t in result] if isinstance(result, tuple) else []


@pytest.mark.multiprocess
@pytest.mark.parametrize("example, sp, overlap", [("gpt", True, True), ("gpt", True, False), ("llama", True, False),
                                                ("llama", False, False)])
def test_each_tensor_parallel_rank_keeps_its_shards_figure(tmp_path, example, sp, overlap):
    """A column-parallel product's seed is a t-th of its output, a row-parallel one's (its partial
    sum, gathered back from the sequence split under SP) whole, but a t-th where it runs in pieces
    with its reduce-scatter (--tp-overlap). In fp32: a bf16 plan priced for a GPU's autocast runs
    its norms in other dtypes under CPU's (the one-process test checks the dtypes)."""
    model = REPO / "examples" / f"{example}.py"
    plan, front, out = _compiled(tmp_path, model=model, pp=3, tp=2, sp=sp, tp_overlap=overlap, microbatches=3,
                                 micro_batch_size=2, global_batch_size=6, device=str(FREE_LINKS))
    seeds = block_weight_seeds(front)
    assert seeds != tuple(b.weight_seed_bytes for b in front.chain.blocks)  # the shards' figure, not the whole one
    assert overlap == any(stage.overlapped for stage in plan.stages[1:])
    predicted = {str(s.index): sum(seeds[s.blocks[0] : s.blocks[1] + 1]) for s in plan.stages[1:]}
    result = run_program([str(REPO / "tests" / "weight_seeds_rank.py"), str(out), str(model), "2"], 2, timeout=300)
    kept = [json.loads(line.split(" ", 2)[2]) for line in result.stdout.splitlines() if line.startswith("kept ")]
    assert kept == [predicted, predicted]


def test_seeds_live_between_i_and_w_on_every_stage_but_the_first():
    assert weight_pending("1f1b", 4, 8, 1) == weight_pending("gpipe", 4, 8, 1) == (0, 0, 0, 0)
    assert weight_pending("interleaved", 2, 4, 2) == (0, 0, 0, 0)
    assert weight_pending("zb-h1", 4, 8, 1) == (0, *transient("zb-h1", 4, 8, 1)[1:]) == (0, 2, 3, 4)
    assert weight_pending("zbv", 2, 4, 2) == (0, *transient("zbv", 2, 4, 2)[1:])


def test_a_zero_bubble_plan_counts_the_seeds_and_a_whole_backward_does_not(tmp_path):
    options = dict(model=GPT, pp=3, microbatches=6, micro_batch_size=2)
    plan, front = compile_plan(CompileOptions(schedule="zb-h1", **options))
    cuts = tuple(s.blocks[1] for s in plan.stages[:-1])
    split = pipeline_problem(CompileOptions(schedule="zb-h1", **options), front, 6)
    whole = pipeline_problem(CompileOptions(schedule="1f1b", **options), front, 6)
    assert whole.block_weight_seed_bytes == () and split.block_weight_seed_bytes == block_weight_seeds(front)
    seeds = block_weight_seeds(front)
    added = [count * sum(seeds[s.blocks[0] : s.blocks[1] + 1]) for s, count in zip(plan.stages, (0, 2, 3))]
    no_seeds = evaluate(dataclasses.replace(split, block_weight_seed_bytes=(), weight_seeds_at_once=()), cuts)
    assert [a - b for a, b in zip(evaluate(split, cuts).rank_memory_bytes, no_seeds.rank_memory_bytes)] == added
    assert plan.predicted.memory_bytes == evaluate(split, cuts).rank_memory_bytes
