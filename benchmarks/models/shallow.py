"""Model files for the planner benchmarks: large models built on the meta device with only a few
of their layers, whose chains ``autopart.solve.repeat`` repeats to the models' full depth
(capturing and annotating 96 layers takes minutes on a small machine; two take seconds).

Each ``ModelFile`` gives the model-file contract's functions for one configuration, without the
module-level ``CONFIG`` that examples/gpt.py and examples/llama_7b.py read, so that several
models can be loaded in one process.
"""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402
import llama_7b  # noqa: E402

llama_example = importlib.import_module("llama")  # examples/llama.py: grouped-query attention


class WideMLP(nn.Module):
    """GPT's MLP with a hidden width of its own, and Megatron's hidden dropout on its output
    (before the residual add, where Megatron's bias-dropout-add puts it)."""

    def __init__(self, n_embd: int, width: int, dropout: float = 0.0):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, width)
        self.c_proj = nn.Linear(width, n_embd)
        self.dropout = dropout

    def forward(self, x):
        y = self.c_proj(F.gelu(self.c_fc(x)))
        return F.dropout(y, self.dropout, self.training) if self.dropout else y


class ExplicitAttention(nn.Module):
    """Causal self-attention as Megatron-LM and Megatron-DeepSpeed ran it before FlashAttention:
    the scores (B, nh, T, T) written out by a batched matmul, a scale-mask-softmax over them,
    dropout on the probabilities, a second matmul with the values; hidden dropout on the output.

    Megatron's fused kernel reads the 16-bit scores and writes 16-bit probabilities, so the
    softmax is asked for in the scores' dtype (under CUDA autocast an explicit dtype is kept, as
    torch's ``fp32_set_opt_dtype`` policy does). The scale is applied to q, not to the scores
    (as Megatron folds it into the score matmul, no pass over T x T); the causal mask is a
    ``masked_fill`` pass of its own, where Megatron's kernel masks inside the softmax."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2) * (1.0 / math.sqrt(hs))  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        scores = q @ k.transpose(-2, -1)  # (B, nh, T, T)
        future = x.new_ones(T, T, dtype=torch.bool).triu(1)  # (T, T)
        scores = scores.masked_fill(future, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=scores.dtype)
        probs = F.dropout(probs, self.dropout, self.training)
        y = (probs @ v).transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        y = self.c_proj(y)
        return F.dropout(y, self.dropout, self.training) if self.dropout else y


@dataclass(frozen=True, kw_only=True)
class ModelFile:
    """``kind`` "gpt" (examples/gpt.py's GPT-2/3 with tied embeddings), "llama" (examples/llama_7b.py)
    or "llama-gqa" (examples/llama.py: grouped-query attention, as Llama 3);
    ``mlp_widths``: per captured GPT layer, its MLP width (default 4 h); ``attention`` of a GPT:
    "fused" (``scaled_dot_product_attention``, as FlashAttention runs it) or "explicit"
    (``ExplicitAttention``); ``dropout``: Megatron's attention and hidden dropout of a GPT."""

    kind: str
    config: object
    mlp_widths: tuple[int, ...] = ()
    attention: str = "fused"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.attention not in ("fused", "explicit"):
            raise ValueError(f"attention is 'fused' or 'explicit', got {self.attention!r}")
        if self.dropout and self.attention == "fused":  # SDPA's own dropout would not be Megatron's
            raise ValueError("dropout is modelled with explicit attention only")

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def seq_len(self) -> int:
        return self.config.block_size if self.kind == "gpt" else self.config.seq_len

    def build_model(self) -> nn.Module:
        with torch.device("meta"):
            if self.kind == "llama":
                return llama_7b.Llama(self.config)
            if self.kind == "llama-gqa":
                return llama_example.Llama(self.config)
            model = gpt.GPT(self.config)
            n_embd = self.config.n_embd
            widths = self.mlp_widths or (4 * n_embd,) * len(model.h)
            for k, (layer, width) in enumerate(zip(model.h, widths)):
                if k < len(self.mlp_widths) or self.dropout:
                    layer.mlp = WideMLP(n_embd, width, self.dropout)
                if self.attention == "explicit":
                    layer.attn = ExplicitAttention(n_embd, self.config.n_head, self.dropout)
            return model

    def example_batch(self, batch_size: int):
        generator = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, self.vocab_size, (batch_size, self.seq_len + 1), generator=generator)
        return (tokens[:, :-1],), tokens[:, 1:]

    @staticmethod
    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, (llama_7b.RMSNorm, llama_example.RMSNorm)):
            nn.init.ones_(module.weight)
        elif isinstance(module, llama_example.Llama):  # its rotary tables, made on the meta device without values
            seq_len, half = module.rope_cos.shape
            cos, sin = llama_example.rotary_tables(2 * half, seq_len, llama_example.LlamaConfig.rope_theta)
            module.rope_cos.copy_(cos)
            module.rope_sin.copy_(sin)


def gpt3(*, n_embd: int, n_head: int, layers: int = 2, seq_len: int = 2048, vocab_size: int = 50304,
         mlp_widths: tuple[int, ...] = (), attention: str = "fused", dropout: float = 0.0) -> ModelFile:
    """GPT-3 (Brown et al. 2020, Table 2.1) with ``layers`` layers; the vocabulary padded to 50,304."""
    config = gpt.GPTConfig(vocab_size=vocab_size, block_size=seq_len, n_layer=layers, n_head=n_head, n_embd=n_embd)
    return ModelFile(kind="gpt", config=config, mlp_widths=mlp_widths, attention=attention, dropout=dropout)


def llama(*, dim: int, n_head: int, ffn_dim: int, vocab_size: int, seq_len: int, layers: int = 2) -> ModelFile:
    config = llama_7b.LlamaConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=layers, n_head=n_head, dim=dim,
                                  ffn_dim=ffn_dim)
    return ModelFile(kind="llama", config=config)


def llama3(*, dim: int, n_head: int, n_kv_head: int, ffn_dim: int, seq_len: int, vocab_size: int = 128256,
           layers: int = 2) -> ModelFile:
    """Llama 3 (Grattafiori et al. 2024, Table 3): grouped-query attention, untied embeddings."""
    config = llama_example.LlamaConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=layers, n_head=n_head,
                                       n_kv_head=n_kv_head, dim=dim, ffn_dim=ffn_dim, rope_theta=500000.0)
    return ModelFile(kind="llama-gqa", config=config)
