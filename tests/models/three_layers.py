"""Three identical layers and a head: the smallest model whose ops repeat, for profiling and
for plans of two stages."""

import torch
from torch import nn

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(Layer(), Layer(), Layer(), nn.Linear(16, 4))

def example_batch(batch_size):
    return (torch.randn(batch_size, 16),), torch.randn(batch_size, 4)

def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
