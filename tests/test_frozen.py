"""Parameters the model does not train (``requires_grad=False``: a pretrained embedding, the
frozen base of a fine-tune) stay as they are in the generated programs too, on every layout: the
stage files declare them frozen, so no gradient reaches them and no optimizer, reduction or sum
of tied copies touches them. Before, every stage declared every parameter trainable, and a run of
more than one rank trained the frozen ones."""

import json

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from autopart.tools.verify import verify

MODEL = """
import torch
from torch import nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64)
        self.emb.weight.requires_grad_(False)
        self.blocks[3].weight = self.blocks[0].weight  # tied, so held by the first stage and the last,
        self.blocks[0].weight.requires_grad_(False)  # and frozen: summing its copies must make no gradient,
        # which AdamW's weight decay would step (an embedding it leaves alone)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.norm(x))


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    tokens = torch.randint(0, 64, (batch_size, 9), generator=torch.Generator().manual_seed(1))
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, 64), target.reshape(-1))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [dict(pp=2, microbatches=4, stage_layers="2,2"),  # both frozen on stage 0
                                    dict(dp=2, zero=1, global_batch_size=8, dtype="bf16")], ids=["pp2", "dp2-zero1-bf16"])
def test_frozen_parameters_stay_frozen(tmp_path, layout):
    model = tmp_path / "frozen.py"
    model.write_text(MODEL)
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, measure=False, **layout), out)
    first = (out / "stages" / "stage_0.py").read_text()
    assert "FROZEN = ('emb.weight', 'blocks.0.weight')" in first, first
    result = verify(out, steps=2, lr=0.1, optimizer="adamw")
    assert result.matches, result.failures


BASE = """
import torch
from torch import nn


def build_model():  # a wide frozen base and a small trained head: a fine-tune's shape
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh())
    base.requires_grad_(FROZEN)
    return nn.Sequential(base, nn.Linear(256, 8))


def example_batch(batch_size):
    return (torch.randn(batch_size, 256),), torch.randint(0, 8, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
"""
FROZEN_NUMEL = 2 * (256 * 256 + 256)


def _base(tmp_path, frozen: bool):
    model = tmp_path / f"base_{frozen}.py"
    model.write_text(BASE.replace("FROZEN", str(not frozen)))
    return model


@pytest.mark.parametrize("dtype, per_parameter", [("fp32", 16 - 4), ("bf16", 18 - 6)])
def test_a_frozen_base_is_costed_as_weights_alone(tmp_path, dtype, per_parameter):
    """No gradient and no optimizer state for a frozen parameter: AdamW's 16 bytes per parameter
    (18 under bf16) fall to its weights' 4 (and bf16's working copy, 6); its activations may fall
    too (a frozen weight's matrix product keeps no input for a weight gradient), by a little here."""
    import autopart

    memory = {frozen: autopart.compile(_base(tmp_path, frozen), pp=1, microbatches=1, global_batch_size=2,
                                       optimizer="adamw", dtype=dtype, measure=False).predicted.memory_bytes[0]
              for frozen in (False, True)}  # fmt: skip
    saved = memory[False] - memory[True]
    assert per_parameter * FROZEN_NUMEL <= saved <= per_parameter * FROZEN_NUMEL + 16 * 1024


def test_the_search_costs_a_frozen_parameter_as_weights_alone(tmp_path):
    import functools

    from autopart.solve.front_table import FrontTable

    table = FrontTable(CompileOptions(model=_base(tmp_path, True), world_size=2, global_batch_size=4,
                                      optimizer="adamw", measure=False))  # fmt: skip
    costs = table.chain_costs(micro_batch_size=2, tp=1, dtype="fp32")
    assert costs.frozen_parameters == {"0.0.weight", "0.0.bias", "0.2.weight", "0.2.bias"}
    # the base's two Linear-Tanh layers repeat, each its own FSDP unit at ZeRO-3: a rank keeps its
    # shard of their weights alone, and the layer it gathers is counted apart, once
    assert costs.frozen_parameters <= costs.layer_parameters
    for zero, dp, frozen_state in ((0, 1, 4), (1, 2, 4), (2, 2, 4 + 4 / 2), (3, 2, 4 / 2)):
        state = costs.with_state(functools.partial(table.state_bytes, dp=dp, zero=zero)).parameter_state_bytes
        assert state["0.0.weight"] == frozen_state * 256 * 256, (zero, dp)
        assert state["1.weight"] == table.state_bytes(4 * 256 * 8, dp=dp, zero=zero), "the trained head as before"
    zero1 = functools.partial(table.owned_bytes, dp=2, zero=1)
    assert zero1(1024, frozen=True) == 0 and zero1(1024, dtype="bf16", frozen=True) == 1024, "no state; bf16's master"


def test_a_fine_tune_that_fits_with_its_base_frozen_is_not_refused(tmp_path):
    """A memory limit half the frozen state's saving under the model trained whole: that does not
    fit, its fine-tune does."""
    import autopart
    from autopart.ir.errors import InfeasibleError

    options = dict(pp=1, microbatches=1, global_batch_size=2, optimizer="adamw", measure=False)
    trained = autopart.compile(_base(tmp_path, False), **options).predicted.memory_bytes[0]
    limit_gib = (trained - 12 * FROZEN_NUMEL // 2) / 2 ** 30
    with pytest.raises(InfeasibleError, match="does not fit"):
        autopart.compile(_base(tmp_path, False), memory_gib=limit_gib, **options)
    assert autopart.compile(_base(tmp_path, True), memory_gib=limit_gib, **options).predicted.memory_bytes[0] <= \
        limit_gib * 2 ** 30


def test_a_frozen_base_takes_no_weight_gradients_optimizer_step_nor_reduction(tmp_path):
    """The runtime computes no weight gradient for a frozen parameter, steps it in no optimizer and
    reduces it over no data-parallel group: the step model counts none of those either (nor the
    base's input gradients: nothing trained lies before it, `test_a_frozen_prefix_costs_no_backward`)."""
    import autopart

    options = dict(pp=1, dp=2, microbatches=1, global_batch_size=64, optimizer="adamw", measure=False)
    trained, frozen = (autopart.compile(_base(tmp_path, f), **options) for f in (False, True))
    assert frozen.stages[0].forward_s == pytest.approx(trained.stages[0].forward_s)
    assert frozen.stages[0].backward_s < 0.7 * trained.stages[0].backward_s, "the base's weight gradients are gone"
    # the head's step and each tensor's fixed cost remain (how large, this CPU's calibration says: 0.06 to
    # 0.10 of the whole); a step that still counted the base would be about all of it
    assert frozen.predicted.rank_tail_s[0] < 0.25 * trained.predicted.rank_tail_s[0], "AdamW steps the head alone"
    reduced = [sum(r) for r in (trained.predicted.reduction_s[0], frozen.predicted.reduction_s[0])]
    assert reduced[1] < 0.5 * reduced[0], "the head's gradients alone are all-reduced"


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("pp", [1, 2])
def test_the_search_reduces_and_steps_only_what_trains(zero, pp):
    """The search's estimate of a fine-tune whose base is frozen: its gradient reduction and
    optimizer step cover the trained head alone, as a model whose base weighs (almost) nothing
    (ZeRO-2 still gathers the frozen weights, as FSDP does). It all-reduced and stepped the whole
    base, so the search ranked a fine-tune's data-parallel layouts on collectives the runtime
    never runs."""
    import dataclasses
    import random

    from autopart.solve.search import Layout, SearchSpace, score_layout
    from tests.synthetic_chains import cluster, random_table

    table = dataclasses.replace(random_table(random.Random(3), layers=2, tied=False),
                                parameter_bytes=(40_000,) * 5 + (4_000,))  # the head: a tenth of a layer
    frozen = dataclasses.replace(table, frozen=frozenset(f"w{k}" for k in range(5)))
    light = dataclasses.replace(table, parameter_bytes=(1,) * 5 + (4_000,))
    devices = cluster(memory_bytes=10 ** 9, gpus_per_node=1, across=10.0)
    space = SearchSpace(world_size=2 * pp, global_batch_size=4, gpus_per_node=1)
    layout = Layout(pp=pp, tp=1, dp=2, micro_batch_size=1, microbatches=2, schedule="1f1b", zero=zero)
    cuts = (2,) if pp == 2 else ()
    estimate = {name: score_layout(layout, t, devices, space, cuts=cuts).estimate_s
                for name, t in (("trained", table), ("frozen", frozen), ("light", light))}
    if zero == 2:  # the frozen base's gathers as the trained model's, its reduce-scatters as the light one's
        assert estimate["light"] < estimate["frozen"] < estimate["trained"]
    else:
        assert estimate["frozen"] == pytest.approx(estimate["light"], rel=0.02) and \
            estimate["trained"] > 2 * estimate["frozen"]


PREFIX = """
import torch
from torch import nn
import torch.nn.functional as F


class Model(nn.Module):  # a frozen embedding and three frozen blocks below three trained ones
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64)
        self.emb.requires_grad_(False)
        for block in self.blocks[:3]:
            block.requires_grad_(False)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.norm(x))


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    tokens = torch.randint(0, 64, (batch_size, 9), generator=torch.Generator().manual_seed(1))
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, 64), target.reshape(-1))
"""
PREFIX_NODES = ("embedding", "linear", "tanh", "add", "linear_1", "tanh_1", "add_1", "linear_2", "tanh_2", "add_2")
"""The frozen prefix's ops: the embedding and blocks 0 to 2."""


def _prefix(tmp_path):
    model = tmp_path / "prefix.py"
    model.write_text(PREFIX)
    return model


def test_a_frozen_prefix_costs_no_backward(tmp_path):
    """Ops that no trained parameter feeds (a frozen embedding and the frozen blocks after it) run
    no backward in training and keep nothing for one: they cost none and save nothing. The first
    trained block computes its weights' gradients, not its input's. Every op was charged an input
    gradient, and a stage of frozen layers predicted a backward the runtime never runs."""
    import autopart
    from autopart.ir.model_file import load_model_file
    from autopart.passes.annotate import annotate
    from autopart.passes.capture import capture
    from cost_models import get_cost_model

    spec = load_model_file(_prefix(tmp_path))
    nodes = annotate(capture(spec, batch_size=2), spec, get_cost_model("cpu"), micro_batch_size=2).nodes
    for name in PREFIX_NODES:
        cost = nodes[name]
        assert not cost.needs_grad and cost.backward_s == 0, name
        assert cost.saved_bytes == cost.selective_saved_bytes == cost.weight_seed_bytes == 0, name
    assert not nodes["blocks_2_weight"].needs_grad and nodes["blocks_3_weight"].needs_grad
    first_trained = nodes["linear_3"]
    assert first_trained.needs_grad and first_trained.backward_input_s == 0 < first_trained.backward_weight_s
    assert nodes["linear_4"].backward_input_s > 0 and nodes["tanh_3"].backward_input_s > 0
    plan = autopart.compile(_prefix(tmp_path), pp=2, stage_layers=(2, 4), microbatches=2, global_batch_size=4,
                            measure=False)
    assert plan.stages[0].backward_s == 0 < plan.stages[0].forward_s, "the frozen stage: no backward"
    assert plan.stages[1].backward_s > plan.stages[1].backward_weight_s > 0
    activations = plan.schedule.microbatches * sum(meta.nbytes for _, meta in plan.stages[0].outputs)
    assert plan.predicted.p2p_bytes_per_step == activations, "no gradient comes back to the frozen stage"
    from autopart.predict.timeline import plan_timeline

    ends = {str(e.action): e.end for e in plan_timeline(plan).events}
    assert ends["0B1"] < ends["1B0"], "the frozen stage's (empty) backward waits for no gradient"


COUNTING = '''
"""train.py ARGS, counting per stage the tanh nodes each backward runs through and the gradient
tensors each send and receive of gradients carries (COUNTS: the folder their rank files go to)."""
import collections
import json
import os
import runpy
import sys

from autopart.runtime import executor
from autopart.schedule import Kind

counts = {"tanh_backward": collections.Counter(), "gradients_sent": collections.Counter(),
          "gradients_received": collections.Counter()}
running = []


def tanh_nodes(outputs):
    seen, queue = set(), [t.grad_fn for t in outputs if t.grad_fn is not None]
    while queue:
        node = queue.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        queue.extend(child for child, _ in node.next_functions)
    return sum("Tanh" in type(node).__name__ for node in seen)


def counted(backward):
    def run(outputs, *args):
        counts["tanh_backward"][running[-1]] += tanh_nodes(outputs)
        return backward(outputs, *args)
    return run


executor.backward_full, executor.backward_input = counted(executor.backward_full), counted(executor.backward_input)
backward, act = executor.Executor._backward, executor.Executor._run


def _backward(self, stage, m, *, split):
    running.append(stage.index)
    backward(self, stage, m, split=split)


def _run(self, action, *args, **kwargs):
    stage = self.stages[action.stage]
    if action.kind is Kind.SEND_B:
        counts["gradients_sent"][action.stage] += len(stage.input_grads[action.microbatch])
    act(self, action, *args, **kwargs)
    if action.kind is Kind.RECV_B:
        counts["gradients_received"][action.stage] += len(stage.output_grads[action.microbatch])
    with open(os.path.join(os.environ["COUNTS"], f"rank_{os.environ['RANK']}.json"), "w") as out:
        json.dump(counts, out)


executor.Executor._backward, executor.Executor._run = _backward, _run
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, tanh_backward, gradients_sent", [
    (dict(stage_layers=(2, 4)), {"1": 3}, {}),
    (dict(stage_layers=(2, 4), schedule="zb-h1"), {"1": 3}, {}),
    (dict(stage_layers=(1, 1, 2, 2), schedule="interleaved", chunks=2), {"2": 1, "3": 2}, {"3": 1}),
], ids=["pp2-1f1b", "pp2-zb-h1", "pp2-interleaved"])
def test_a_frozen_prefix_runs_no_backward_and_trains_as_one_process(tmp_path, layout, tanh_backward, gradients_sent):
    """A frozen prefix spanning the first stage (or two) and part of the next: the stages make
    received tensors that nothing trained lies before no leaves of autograd, so the frozen ops of
    the later stage record nothing and run no backward (a tanh each: the trained blocks' alone are
    counted), and no gradient crosses a boundary behind which nothing trains. Training still
    matches one process. Every received float tensor was made to require grad: the later stage
    ran its frozen ops' backward and sent a gradient back that the first stage threw away."""
    from tests.distributed import run_program

    out = tmp_path / "out"
    plan, _ = compile_to_directory(CompileOptions(model=_prefix(tmp_path), pp=2, microbatches=4, global_batch_size=8,
                                                  measure=False, **layout), out)
    frozen_boundaries = [(), ("add_1",)] if len(plan.stages) == 2 else [(), ("add",), ("add_1",), ()]
    assert [s.no_grad_inputs for s in plan.stages] == frozen_boundaries  # a frozen block's output
    result = verify(out, steps=3, lr=0.1, optimizer="sgd")
    assert result.matches, result.failures
    counting = tmp_path / "counting.py"
    counting.write_text(COUNTING)
    folder = tmp_path / "counts"
    folder.mkdir()
    run_program([str(counting), str(out / "train.py"), "--timeout", "120", "--steps", "1"], 2,
                env={"COUNTS": str(folder)})
    counts = [json.loads((folder / f"rank_{rank}.json").read_text()) for rank in range(2)]
    microbatches = 4
    for kind, expected in (("tanh_backward", tanh_backward), ("gradients_sent", gradients_sent)):
        found = {stage: n for rank in counts for stage, n in rank[kind].items() if n}
        assert found == {stage: n * microbatches for stage, n in expected.items()}, (kind, found)
    received = {stage: n for rank in counts for stage, n in rank["gradients_received"].items() if n}
    assert received == {str(int(stage) - 1): n * microbatches for stage, n in gradients_sent.items()}


def test_a_plan_names_the_received_tensors_that_take_no_gradient(tmp_path):
    """The plan carries which received tensors need no gradient, where any do (a model with nothing
    frozen writes its stages as before), reads them back, and refuses one the stage does not receive."""
    import autopart
    from autopart.ir.errors import PlanError
    from autopart.ir.plan import Plan

    plan = autopart.compile(_prefix(tmp_path), pp=2, stage_layers=(2, 4), microbatches=2, global_batch_size=4,
                            measure=False)
    data = plan.to_json()
    assert "no_grad_inputs" not in data["stages"][0] and data["stages"][1]["no_grad_inputs"] == ["add_1"]
    assert Plan.from_json(data).stages[1].no_grad_inputs == ("add_1",)
    data["stages"][1]["no_grad_inputs"] = ["add_9"]
    with pytest.raises(PlanError, match=r"plan\.stages\[1\]\.no_grad_inputs names \['add_9'\], which the stage"):
        Plan.from_json(data)
    del data["stages"][1]["no_grad_inputs"]  # a plan written before them, pinned: the model decides them
    pinned = tmp_path / "plan.json"
    pinned.write_text(json.dumps(data))
    assert autopart.compile(_prefix(tmp_path), plan=pinned, measure=False).stages[1].no_grad_inputs == ("add_1",)


WRITES = """
import torch
from torch import nn


class Writes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        buf = torch.zeros_like(x)
        before = buf * 2
        buf.view(-1).add_(self.lin(x).view(-1))
        return buf * 3 + before


def build_model():
    return Writes()


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()
"""


def test_a_value_written_in_place_with_a_trained_one_needs_a_gradient_from_then_on(tmp_path):
    """A buffer made from the batch needs no gradient until a trained value is written into it
    through a view (``buf.view(-1).add_(y)``): its readers after the write take a gradient, and
    one that read it before does not. Sent across a boundary as needing none, the write's
    gradient would be dropped without a word."""
    from autopart.ir.model_file import load_model_file
    from autopart.passes.annotate import annotate
    from autopart.passes.capture import capture
    from cost_models import get_cost_model

    model = tmp_path / "writes.py"
    model.write_text(WRITES)
    spec = load_model_file(model)
    nodes = annotate(capture(spec, batch_size=2), spec, get_cost_model("cpu"), micro_batch_size=2).nodes
    assert nodes["zeros_like"].needs_grad and nodes["view"].needs_grad and nodes["mul_1"].needs_grad
    assert not nodes["mul"].needs_grad and not nodes["x"].needs_grad
