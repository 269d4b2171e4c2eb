"""A small Transformer-like model that branches on shapes in Python: it pads sequences to a
multiple of the window and picks its attention path by sequence length. torch.fx cannot trace
either branch (the shapes are symbols there); torch.export takes the branch the example's shapes
select, which is the one every microbatch takes.

    autopart compile tests/models/shape_branch.py -o out/shape_branch --pp 2 --microbatches 4
"""

import torch
from torch import nn
from torch.nn import functional as F

DIM, SEQ, WINDOW, HEADS, LAYERS, VOCAB = 32, 14, 4, 2, 4, 64


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if T > WINDOW:  # long sequences: attend within windows of WINDOW tokens
            q, k, v = (t.reshape(B, HEADS, T // WINDOW, WINDOW, C // HEADS) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).reshape(B, HEADS, T, C // HEADS)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, C))


class Windowed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixers = nn.ModuleList(Mixer() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        T = tokens.shape[1]
        if T % WINDOW:  # pad to whole windows, and cut the padding off the logits
            tokens = F.pad(tokens, (0, WINDOW - T % WINDOW))
        x = self.embed(tokens)  # (B, T', DIM)
        for mixer in self.mixers:
            x = mixer(x)
        return self.head(x)[:, :T]  # (B, T, VOCAB)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Windowed()


def example_batch(batch_size: int):
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
