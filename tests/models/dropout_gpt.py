"""A small GPT with dropout after attention and after the MLP, whole in one file (a compiled copy
imports nothing beside it): tests/test_dropout.py and benchmarks/gpu_check.py train it with recompute,
where every recomputed forward must draw the random numbers that its first forward drew, on
the accelerator's generator as on the CPU's."""

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQUENCE, WIDTH, HEADS, LAYERS, DROPOUT = 512, 32, 64, 4, 4, 0.1
ATTENTION_DROPOUT = 0.0  # on the probabilities, inside the fused attention (a test sets it in a copy)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q = q.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        k = k.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        v = v.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        p = ATTENTION_DROPOUT if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + F.dropout(self.proj(y), DROPOUT, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln_2(x)))), DROPOUT, self.training)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQUENCE, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size: int):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQUENCE + 1), generator=torch.Generator().manual_seed(1234))
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
