"""A Llama-2-7B-shaped model (6.7B parameters) built on the meta device: autopart captures,
costs, solves and emits it without allocating one weight, and each pipeline rank makes only its
own stage's weights, with this file's ``init_weights``, when it starts.

    autopart compile examples/llama_7b.py -o out/llama_7b --device h100-sxm --pp 16 --microbatches 32 --global-batch-size 32
    python benchmarks/compile_meta_7b.py  # the same, timed, with the compile's peak memory

Rotary tables are computed in forward (they depend only on positions), so the model holds no
buffer that would need values at build time.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 32000
    seq_len: int = 4096
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    ffn_dim: int = 11008
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


CONFIG = LlamaConfig()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, cos, sin):
    # x: (B, nh, T, hs); rotate pairs (x1, x2) of the two halves of each head
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.dim // config.n_head
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = self.wv(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens):
        T, head_dim = tokens.shape[1], self.config.dim // self.config.n_head
        inv_freq = 1.0 / self.config.rope_theta ** (
            torch.arange(0, head_dim, 2, device=tokens.device).float() / head_dim
        )
        angles = torch.outer(torch.arange(T, device=tokens.device).float(), inv_freq)  # (T, hs/2)
        cos, sin = angles.cos(), angles.sin()
        x = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))  # (B, T, vocab)


def build_model() -> nn.Module:
    with torch.device("meta"):
        return Llama(CONFIG)


def init_weights(module: nn.Module) -> None:
    """Initialise the parameters that ``module`` itself holds (called per module, on the rank that holds them)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)


def example_batch(batch_size: int):
    generator = torch.Generator().manual_seed(4321)
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.seq_len + 1), generator=generator)
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
