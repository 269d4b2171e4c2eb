"""A residual-free MLP whose first and last layers share their weight: under bf16 autocast every
tensor between its layers is bf16, so the activations that stages send each other and the
gradients they send back are bf16, and the tied weight's gradients are summed across stages.

    autopart compile tests/models/tanh_mlp.py -o out/tanh_mlp --pp 2 --microbatches 4 --dtype bf16
"""

import torch
from torch import nn
from torch.nn import functional as F

DIM, LAYERS = 32, 6


class TanhMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.layers[-1].weight = self.layers[0].weight  # tied, held by the first and the last stage

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))  # (B, DIM)
        return self.layers[-1](x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TanhMLP()


def example_batch(batch_size: int):
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(batch_size, DIM, generator=generator),), torch.randn(batch_size, DIM, generator=generator)


def loss_fn(output, target):
    return F.mse_loss(output, target)
