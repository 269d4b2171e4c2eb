"""A small language model built on the meta device, with a tied head and a module that only
this file knows how to initialise: ``init_weights`` is called, per module, on the rank that holds
it (``autopart/runtime/materialise.py``).

    autopart compile tests/models/meta_lm.py -o out/meta_lm --pp 2 --microbatches 4
"""

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ, DIM, LAYERS = 64, 8, 32, 4


class Gate(nn.Module):
    """A learned per-channel gate: no reset_parameters(), init_weights() sets it."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        return x * torch.sigmoid(self.scale)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.gate = Gate(DIM)

    def forward(self, x):
        return x + self.gate(self.down(F.gelu(self.up(self.norm(x)))))  # (B, T, DIM)


class MetaLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens):
        x = self.embed(tokens)  # (B, T, DIM)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (B, T, VOCAB)


def build_model() -> nn.Module:
    with torch.device("meta"):
        return MetaLM()


def init_weights(module: nn.Module) -> None:
    if isinstance(module, Gate):
        nn.init.uniform_(module.scale, -1.0, 1.0)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def example_batch(batch_size: int):
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
