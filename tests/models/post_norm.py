"""Post-norm Transformer layers (the original Transformer's and BERT's order: the norm after the
residual add), so that a norm's output is read by the next linear and by the next residual add.
Under sequence parallelism the residual reads it split and the linear gathered: the gather has
one reader, and the generated code fuses it with the linear (``tp.gathered_linear``).

Built on the meta device at sizes where a GPU's costs make the solver split it as Megatron does,
to be compiled against a GPU's spec, not run:

    autopart compile tests/models/post_norm.py -o out/post_norm --tp 2 --device h100-sxm --dtype bf16
"""

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ, DIM, HEADS, LAYERS = 1024, 1024, 1024, 8, 2


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln_1 = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.out = nn.Linear(4 * DIM, DIM)
        self.ln_2 = nn.LayerNorm(DIM)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = self.ln_1(x + self.proj(attended))
        return self.ln_2(x + self.out(F.gelu(self.fc(x))))


class PostNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.ln(self.embed(idx))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model() -> nn.Module:
    with torch.device("meta"):
        return PostNorm()


def init_weights(module: nn.Module) -> None:
    for p in module.parameters(recurse=False):
        nn.init.normal_(p, std=0.02)


def example_batch(batch_size: int):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
