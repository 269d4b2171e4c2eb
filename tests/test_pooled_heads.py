"""A classifier that pools its layers' stream before the head is cut between its layers.

A CNN's mean over the image and a ViT's first token make features narrower than any layer's
stream, and before the head: taken as the narrowest point of the model, they threw every layer
cut away, so that ``--pp 2`` gave the last stage the head alone and ``--stage-layers`` said the
model had one layer (``blocks.0 to blocks.0``) of four.
"""

import pytest

from autopart.driver import CompileOptions, compile_plan, compile_to_directory
from autopart.tools.verify import verify

LAYERS = 4

MODEL = '''
import torch
from torch import nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self):
        super().__init__()
{block_init}

    def forward(self, x):
{block_forward}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
{model_init}
        self.blocks = nn.ModuleList(Block() for _ in range({layers}))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head({pool})


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, {input_shape}, generator=generator),), torch.randint(0, 10, (batch_size,), generator=generator)


def loss_fn(out, target):
    return F.cross_entropy(out, target)
'''

VARIANTS = {
    "cnn-mean": dict(  # a ResNet's global average pool
        block_init="        self.conv = nn.Conv2d(16, 16, 3, padding=1)",
        block_forward="        return x + F.relu(self.conv(x))",
        model_init="        self.stem = nn.Conv2d(3, 16, 3, padding=1)",
        pool="h.mean(dim=(2, 3))",  # (B, 16) of a (B, 16, 8, 8) stream
        input_shape="3, 8, 8",
    ),
    "vit-first-token": dict(  # a ViT's or BERT's class token, normed
        block_init="        self.norm = nn.LayerNorm(16)\n        self.mlp = nn.Linear(16, 16)",
        block_forward="        return x + F.gelu(self.mlp(self.norm(x)))",
        model_init="        self.stem = nn.Linear(12, 16)\n        self.norm = nn.LayerNorm(16)",
        pool="self.norm(h[:, 0])",  # (B, 16) of a (B, 8, 16) stream
        input_shape="8, 12",
    ),
}


def model_file(tmp_path, variant: str):
    path = tmp_path / f"{variant.replace('-', '_')}.py"
    path.write_text(MODEL.format(layers=LAYERS, **VARIANTS[variant]))
    return path


def layer_stages(plan) -> dict[str, set[int]]:
    """Per layer (``blocks.0``, ...), the stages that hold its parameters."""
    held: dict[str, set[int]] = {}
    for stage in plan.stages:
        for name in stage.parameters:
            if name.startswith("blocks."):
                held.setdefault(".".join(name.split(".")[:2]), set()).add(stage.index)
    return held


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_layers_are_spread_over_the_stages(tmp_path, variant):
    plan, _ = compile_plan(CompileOptions(model=model_file(tmp_path, variant), pp=2, microbatches=2, measure=False))
    held = layer_stages(plan)
    assert sorted(held) == [f"blocks.{k}" for k in range(LAYERS)]
    assert all(len(stages) == 1 for stages in held.values()), held
    assert {0, 1} == set().union(*held.values()), f"each stage holds some layer: {held}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_stage_layers_count_every_layer(tmp_path, variant):
    plan, _ = compile_plan(CompileOptions(model=model_file(tmp_path, variant), pp=2, microbatches=2,
                                          stage_layers=(1, 3), measure=False))  # fmt: skip
    held = layer_stages(plan)
    assert [held[f"blocks.{k}"] for k in range(LAYERS)] == [{0}, {1}, {1}, {1}]


@pytest.mark.multiprocess
def test_a_pipeline_of_a_pooled_classifier_trains_like_one_process(tmp_path):
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model_file(tmp_path, "cnn-mean"), pp=2, microbatches=2, measure=False),
                         out)  # fmt: skip
    result = verify(out, steps=2)
    assert result.matches, result.failures
