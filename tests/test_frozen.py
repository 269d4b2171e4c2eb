"""Parameters the model does not train (``requires_grad=False``: a pretrained embedding, the
frozen base of a fine-tune) stay as they are in the generated programs too, on every layout: the
stage files declare them frozen, so no gradient reaches them and no optimizer, reduction or sum
of tied copies touches them. Before, every stage declared every parameter trainable, and a run of
more than one rank trained the frozen ones."""

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
@pytest.mark.parametrize("layout", [dict(pp=2, microbatches=4), dict(dp=2, zero=1, global_batch_size=8, dtype="bf16")],
                         ids=["pp2", "dp2-zero1-bf16"])
def test_frozen_parameters_stay_frozen(tmp_path, layout):
    model = tmp_path / "frozen.py"
    model.write_text(MODEL)
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, measure=False, **layout), out)
    first = (out / "stages" / "stage_0.py").read_text()
    assert "FROZEN = ('emb.weight', 'blocks.0.weight')" in first, first
    result = verify(out, steps=2, lr=0.1, optimizer="adamw")
    assert result.matches, result.failures
