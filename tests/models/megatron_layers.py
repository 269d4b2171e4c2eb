"""Transformer layers as Korthikanti et al. count their activations (MLSys'23, §4.1): attention
written out (scores, softmax, dropout on the probabilities, then the values), dropout after the
attention projection and after the MLP, GeLU, pre-norm LayerNorms; every tensor 16-bit.

Built on the meta device at the paper's shapes, so that the memory model's bytes per layer can be
set against their formulas without a weight allocated. The sizes are module constants that a test
overrides (``LAYERS`` especially: one layer's bytes are the difference of two depths). The vocabulary is
wider than the hidden size so that the residual stream, not the logits, is the narrowest point.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQUENCE, HIDDEN, HEADS, LAYERS, DROPOUT = 8192, 2048, 4096, 32, 2, 0.1
SIZE_OF_NORMED = False  # read the shape off the normed input, as nanoGPT's attention does (``x.size()``)
SPLIT_QKV = False  # q, k and v as three linears of the normed input, as Llama writes them


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN)
        if SPLIT_QKV:
            self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        else:
            self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.out = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.ln_1(x)
        B, T, C = normed.size() if SIZE_OF_NORMED else x.shape
        q, k, v = (self.q(normed), self.k(normed), self.v(normed)) if SPLIT_QKV else self.qkv(normed).split(C, dim=2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)  # (B, a, T, hs)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // HEADS))  # (B, a, T, T)
        probabilities = F.dropout(F.softmax(scores, dim=-1), DROPOUT, self.training)
        attended = (probabilities @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + F.dropout(self.proj(attended), DROPOUT, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln_2(x)))), DROPOUT, self.training)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.h = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for layer in self.h:
            x = layer(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    with torch.device("meta"):
        return Model().to(torch.bfloat16)


def init_weights(module: nn.Module) -> None:
    for p in module.parameters(recurse=False):
        nn.init.normal_(p, std=0.02)


def example_batch(batch_size: int):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQUENCE + 1), generator=torch.Generator().manual_seed(0))
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
