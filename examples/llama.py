"""A Llama-style Transformer: RMSNorm, rotary position embeddings, SwiGLU and grouped-query
attention, with untied embeddings.

Compile it as it is:

    autopart compile examples/llama.py -o out/llama --pp 2 --microbatches 4
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 384
    seq_len: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    dim: int = 64
    ffn_dim: int = 176
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


CONFIG = LlamaConfig()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    # x: (B, nh, T, hs); rotate pairs (x1, x2) of the two halves of each head
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.dim // config.n_head
        self.wq = nn.Linear(config.dim, config.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * self.head_dim, config.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeats = self.n_head // self.n_kv_head
        k = k.repeat_interleave(repeats, dim=1)  # (B, nh, T, hs)
        v = v.repeat_interleave(repeats, dim=1)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


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
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.dim // config.n_head, config.seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, tokens):
        cos, sin = self.rope_cos, self.rope_sin  # (T, hs/2): sequences are always seq_len long
        x = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))  # (B, T, vocab)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Llama(CONFIG)


def example_batch(batch_size: int):
    generator = torch.Generator().manual_seed(4321)
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.seq_len + 1), generator=generator)
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
