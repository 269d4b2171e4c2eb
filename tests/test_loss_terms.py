"""A loss of more than one term is cut between layers as a loss of one term is.

A z-loss, an auxiliary value the model returns beside its logits (in a tuple or a dict), or an
MoE-style auxiliary loss that each layer adds to a running sum: each leaves small values on their
way to the loss live beside the residual stream. Measured with the stream, the point after two
loss scalars exist was the narrowest of the graph, or a layer boundary carried one tensor more
than the points before the first layer's term: either way no cut between layers was left, and
the whole model was one block (``--pp 2`` gave its second stage no parameters; ``--pp 3`` a middle
stage of ``0.0001 * mean``; ``--first-stage-layers`` counted one layer of three).
"""

import pytest

from autopart.driver import CompileOptions, compile_plan, compile_to_directory
from autopart.tools.verify import verify
from tests.distributed import REPO

LAYERS, D, V, T = 3, 32, 64, 8

MODEL = '''
import torch
from torch import nn
import torch.nn.functional as F

D, V, T = {D}, {V}, {T}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x):
{block}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range({layers}))
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        x = self.emb(idx)  # (B, T, D)
{forward}


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    tokens = torch.randint(0, V, (batch_size, T + 1), generator=torch.Generator().manual_seed(1))
    return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()


def loss_fn(out, target):
{loss}
'''

PLAIN_BLOCK = "        return x + self.down(F.gelu(self.up(self.norm(x))))"
PLAIN_FORWARD = """        for block in self.blocks:
            x = block(x)"""
CROSS_ENTROPY = "F.cross_entropy(logits.view(-1, V), target.view(-1))"

VARIANTS = {
    "z-loss": dict(
        block=PLAIN_BLOCK,
        forward=PLAIN_FORWARD + "\n        return self.head(x)",
        loss=f"    logits = out\n    return {CROSS_ENTROPY} + 1e-4 * torch.logsumexp(out, -1).pow(2).mean()",
    ),
    "tuple-aux": dict(  # a term computed once, from the last layer's output
        block=PLAIN_BLOCK,
        forward=PLAIN_FORWARD + "\n        return self.head(x), x.pow(2).mean()",
        loss=f"    logits, aux = out\n    return {CROSS_ENTROPY} + 1e-3 * aux",
    ),
    "dict-aux": dict(
        block=PLAIN_BLOCK,
        forward=PLAIN_FORWARD + """
        logits = self.head(x)
        return {"logits": logits, "aux": torch.logsumexp(logits, -1).pow(2).mean()}""",
        loss=f"    logits = out['logits']\n    return {CROSS_ENTROPY} + 1e-4 * out['aux']",
    ),
    "moe-aux": dict(  # each layer adds its balance term to a running sum that crosses every layer boundary
        block="""        h = F.gelu(self.up(self.norm(x)))
        balance = h.softmax(-1).mean((0, 1)).pow(2).sum()  # a router's load-balancing term
        return x + self.down(h), balance""",
        forward="""        aux = x.new_zeros(())
        for block in self.blocks:
            x, balance = block(x)
            aux = aux + balance
        return self.head(x), aux""",
        loss=f"    logits, aux = out\n    return {CROSS_ENTROPY} + 1e-2 * aux",
    ),
}


def model_file(tmp_path, variant: str):
    path = tmp_path / f"{variant.replace('-', '_')}.py"
    path.write_text(MODEL.format(D=D, V=V, T=T, layers=LAYERS, **VARIANTS[variant]))
    return path


def layer_stages(plan) -> dict[str, set[int]]:
    """Per module of the model (``emb``, ``blocks.0``, ..., ``head``), the stages that hold its parameters."""
    held: dict[str, set[int]] = {}
    for stage in plan.stages:
        for name in stage.parameters:
            module = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else name.split(".")[0]
            held.setdefault(module, set()).add(stage.index)
    return held


def assert_cut_between_layers(plan, pp: int) -> None:
    assert len(plan.stages) == pp
    for stage in plan.stages:
        assert stage.parameters, f"stage {stage.index} holds no parameter: {stage.nodes}"
    held = layer_stages(plan)
    assert sorted(held) == ["blocks.0", "blocks.1", "blocks.2", "emb", "head"]
    for module, stages in held.items():
        assert len(stages) == 1, f"{module} is split across stages {sorted(stages)}"
    for stage in plan.stages[:-1]:  # the residual stream crosses, and beside it only scalars on their way to the loss
        shapes = [tuple(meta.shape) for _, meta in stage.outputs]
        assert [shape for shape in shapes if shape] == [(plan.schedule.micro_batch_size, T, D)], shapes


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_stage_holds_whole_layers(tmp_path, variant, pp):
    plan, _ = compile_plan(CompileOptions(model=model_file(tmp_path, variant), pp=pp, microbatches=4, measure=False))
    assert_cut_between_layers(plan, pp)


def test_the_running_auxiliary_sum_crosses_beside_the_stream(tmp_path):
    plan, front = compile_plan(CompileOptions(model=model_file(tmp_path, "moe-aux"), pp=2, microbatches=4,
                                              measure=False))  # fmt: skip
    assert [tuple(meta.shape) for _, meta in plan.stages[0].outputs] == [(2, T, D), ()]
    # after the embedding and after each layer: the stream and the sum so far (the first: a zero)
    assert len(front.chain.boundaries) == LAYERS + 1
    for boundary in front.chain.boundaries:
        assert sorted(tuple(meta.shape) for _, meta in boundary.tensors) == [(), (2, T, D)], boundary


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_first_stage_layers_count_every_layer(tmp_path, variant):
    plan, _ = compile_plan(CompileOptions(model=model_file(tmp_path, variant), pp=2, microbatches=2,
                                          first_stage_layers=2, measure=False))  # fmt: skip
    held = layer_stages(plan)
    assert [held[f"blocks.{k}"] for k in range(LAYERS)] == [{0}, {0}, {1}]


def test_a_head_narrower_than_the_stream_leaves_the_layer_cuts():
    """A regressor's four outputs per sample are fewer than its layers' sixteen: they set no width."""
    plan, _ = compile_plan(CompileOptions(model=REPO / "tests" / "models" / "three_layers.py", pp=2, microbatches=2,
                                          measure=False))  # fmt: skip
    assert all(stage.parameters for stage in plan.stages)
    assert {name.split(".")[0] for name in plan.stages[1].parameters} & {"0", "1", "2"}, plan.stages[1].parameters


@pytest.mark.multiprocess
def test_a_pipeline_of_a_per_layer_auxiliary_loss_trains_like_one_process(tmp_path):
    out = tmp_path / "out"
    plan, _ = compile_to_directory(
        CompileOptions(model=model_file(tmp_path, "moe-aux"), pp=2, microbatches=2, measure=False), out
    )
    assert_cut_between_layers(plan, 2)
    result = verify(out, steps=2)
    assert result.matches, result.failures
