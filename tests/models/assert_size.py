"""A residual MLP whose forward asserts on its input's size: torch.fx cannot trace the assert
(the size is a symbol there), so autopart captures it with torch.export.

    autopart compile tests/models/assert_size.py -o out/assert_size --pp 2 --microbatches 4
"""

import torch
from torch import nn
from torch.nn import functional as F

DIM, SEQ, LAYERS = 32, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))  # (B, T, DIM)


class Checked(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        assert x.size(1) == SEQ and x.size(2) == DIM, f"expected (B, {SEQ}, {DIM}), got {tuple(x.shape)}"
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (B, T, DIM)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Checked()


def example_batch(batch_size: int):
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(batch_size, SEQ, DIM, generator=generator),), torch.randn(batch_size, SEQ, DIM, generator=generator)


def loss_fn(output, target):
    return F.mse_loss(output, target)
