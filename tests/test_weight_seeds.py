"""What a split backward keeps from I to W (`autopart.passes.weight_seeds`): the figure the memory
model counts per block is, summed over a stage, the bytes the runtime's own I keeps for the
stage's W, in one process and on each rank of a tensor-parallel group; and the zero-bubble plans
count them, for the microbatches held between I and W, on every stage but the first."""

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from autopart.codegen.emit import emit_directory
from autopart.driver import CompileOptions, compile_plan
from autopart.ir.model_file import load_model_file
from autopart.passes.front import block_weight_seeds
from autopart.passes.weight_seeds import arg_nodes, arg_places
from autopart.predict.in_flight import in_flight, rank_in_flight, transient, weight_pending
from autopart.runtime.backward import backward_input
from autopart.runtime.forward import StageForward
from autopart.runtime.stage import load_stage
from autopart.schedule import stage_placement
from autopart.solve.assemble import pipeline_problem
from autopart.solve.fitting import fitting_cuts, memory_lower_bound
from autopart.solve.pipeline import PipelineProblem, evaluate, solve_cuts, stage_ranges
from tests.distributed import FREE_LINKS, REPO, run_program
from tests.test_solver_fitting import interleaved_problem

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


def _each_stage_keeps_its_figure(plan, front, out, model: Path, dtype: str) -> None:
    """Run each stage's forward and I in this process, as the executor runs them, and compare what
    I keeps with the stage's blocks' figures."""
    seeds = block_weight_seeds(front)
    inputs, target = load_model_file(model).example(plan.schedule.micro_batch_size)
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


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "bf16-autocast"])
def test_a_stage_keeps_for_its_weight_gradients_what_its_blocks_figures_sum_to(tmp_path, dtype):
    plan, front, out = _compiled(tmp_path, pp=3, microbatches=3, micro_batch_size=2, dtype=dtype)
    _each_stage_keeps_its_figure(plan, front, out, GPT, dtype)


HAND_TIED = """
import torch
from torch import nn
from torch.nn import functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.scale = nn.Parameter(torch.zeros(32))
        self.queries = nn.Parameter(torch.zeros(1, 8, 32))

    def forward(self, idx):
        x = self.wte(idx)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        x = x + self.queries.expand(x.size(0), -1, -1)  # learned queries: made from a parameter and a size
        x = x * (1 + self.scale)  # a norm's weight as Gemma holds it: made from a parameter
        return x @ self.wte.weight.t()  # the tied head written by hand


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    generator = torch.Generator().manual_seed(0)
    return (torch.randint(0, 64, (batch_size, 8), generator=generator),), torch.randint(0, 64, (batch_size, 8))


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())
"""


def test_an_op_that_reads_a_value_made_from_parameters_alone_keeps_seeds_as_at_a_parameter(tmp_path):
    """Autograd reaches only the parameter past ``wte.weight.t()``, ``1 + scale`` and the queries
    expanded to the batch's size: the ops that read them are frontier nodes, as if they read the
    parameters themselves."""
    model = tmp_path / "hand_tied.py"
    model.write_text(HAND_TIED)
    plan, front, out = _compiled(tmp_path, model=model, pp=2, microbatches=2, micro_batch_size=2)
    nodes = front.op_graph.nodes
    head = next(n for n in front.op_graph.fx_nodes() if any(a.op != "get_attr" and nodes[a.name].output is not None
                                                             and a.target == "t" for a in n.all_input_nodes))
    assert nodes[head.name].weight_seed_bytes == nodes[head.name].output.nbytes  # the logits' gradient
    _each_stage_keeps_its_figure(plan, front, out, model, "fp32")


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
    assert weight_pending("zbv", 2, 4, 2) == (0, 2, 1, 1)  # the V's chunks: rank 1 holds back one W, rank 0 none


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


def _zbv_problem(seed: int) -> PipelineProblem:
    """Eight alike blocks (`interleaved_problem`'s) on a zbv V of 2 ranks (stages 0 and 3 on rank
    0), each block keeping seeds for its W about as large as what it saves."""
    rng = random.Random(seed)
    microbatches = 4
    return dataclasses.replace(
        interleaved_problem(8, ranks=2, chunks=2, limit=1 << 40, seed=seed), microbatches=microbatches,
        in_flight=in_flight("zbv", 2, microbatches, 2), rank_in_flight=rank_in_flight("zbv", 2, microbatches, 2),
        stage_rank=stage_placement("zbv", ranks=2, chunks=2),
        block_weight_seed_bytes=tuple(rng.randint(80, 120) * 1000 for _ in range(8)),
        weight_seeds_at_once=weight_pending("zbv", 2, microbatches, 2),
    )


@pytest.mark.parametrize("seed", range(4))
def test_the_cut_solvers_count_the_seeds_a_rank_keeps(seed):
    """evaluate adds each stage's seeds times its count to its rank (computed here by hand); under
    a limit that only some cuts meet, CP-SAT's cuts are the best of those that fit, the fitting
    heuristics' fit, and no cut needs less than their bound."""
    problem = _zbv_problem(seed)
    plain = dataclasses.replace(problem, block_weight_seed_bytes=(), weight_seeds_at_once=())
    every = list(itertools.combinations(range(7), 3))
    for cuts in every[::7]:
        ranges = stage_ranges(cuts, 8)
        added = [0, 0]
        for s, members in enumerate(ranges):
            added[problem.rank_of(s)] += problem.weight_seeds_at_once[s] * sum(problem.block_weight_seed_bytes[k]
                                                                               for k in members)
        assert [a - b for a, b in zip(evaluate(problem, cuts).rank_memory_bytes,
                                      evaluate(plain, cuts).rank_memory_bytes)] == added
    needs = sorted(max(evaluate(problem, cuts).rank_memory_bytes) for cuts in every)
    # a limit that the fastest cuts meet without their seeds and break with them
    fastest = min(every, key=lambda cuts: evaluate(plain, cuts).objective_s)
    limited = dataclasses.replace(problem, memory_limit_bytes=max(evaluate(problem, fastest).rank_memory_bytes) - 1)
    fitting = [evaluate(limited, cuts) for cuts in every if max(evaluate(limited, cuts).rank_memory_bytes)
               <= limited.memory_limit_bytes]
    assert fitting and max(evaluate(plain, fastest).rank_memory_bytes) <= limited.memory_limit_bytes
    solved = solve_cuts(limited, time_limit_s=20)
    assert solved.status == "optimal"
    assert solved.evaluation.objective_s == pytest.approx(min(e.objective_s for e in fitting), rel=1e-6)
    found = fitting_cuts(limited)
    assert found is not None and max(evaluate(limited, found).rank_memory_bytes) <= limited.memory_limit_bytes
    assert memory_lower_bound(plain) < memory_lower_bound(problem) <= needs[0]


def test_ops_share_a_measurement_only_where_they_read_nodes_in_the_same_places():
    """A cost key shows a number by its value, whether a node or a constant gives it: the places
    `OpSeeds` keeps index the node arguments, so those must be alike."""
    traced = torch.fx.symbolic_trace(lambda x, s: (torch.mul(x, 0.5), torch.mul(x, s)))
    first, second = [n for n in traced.graph.nodes if n.op == "call_function"][:2]
    assert arg_places(first) == (True, False) and arg_places(second) == (True, True)
    assert [a.name for a in arg_nodes(second)] == ["x", "s"]
