"""One linear layer and its loss: the only cut it has falls before the loss, so at --pp 2 the
last stage holds no parameter (a rank whose optimizer has nothing to step)."""

import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Linear(16, 4)


def example_batch(batch_size):
    return (torch.randn(batch_size, 16),), torch.randn(batch_size, 4)


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
