"""Residual MLP layers (tests/models/assert_size.py's block) whose last layer's up-projection is
also the head's weight: that layer's tensors are read outside its stage method, so it is not an
FSDP unit of its own (``layer_methods`` leaves it out), yet full recompute checkpoints its calls
like the others' (``layer_calls``).

    autopart compile tests/models/tied_residual_mlp.py -o out/tied --pp 2 --stage-layers 5,1 --recompute full
"""

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from assert_size import DIM, Block  # noqa: E402

LAYERS = 6


class TiedResidualMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.out = nn.Linear(DIM, 4 * DIM)
        self.out.weight = self.layers[-1].up.weight  # (4 DIM, DIM): read by the last layer and the head

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TiedResidualMLP()


def example_batch(batch_size: int):
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(batch_size, 16, DIM, generator=generator)
    return (inputs,), torch.randn(batch_size, 16, 4 * DIM, generator=generator)


def loss_fn(output, target):
    return F.mse_loss(output, target)
