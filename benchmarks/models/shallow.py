"""Model files for the planner benchmarks: large models built on the meta device with only a few
of their layers, whose chains ``autopart.solve.repeat`` repeats to the models' full depth
(capturing and annotating 96 layers takes minutes on a small machine; two take seconds).

Each ``ModelFile`` gives the model-file contract's functions for one configuration, without the
module-level ``CONFIG`` that examples/gpt.py and examples/llama_7b.py read, so that several
models can be loaded in one process.
"""

from __future__ import annotations

import importlib
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
    """GPT's MLP with a hidden width of its own."""

    def __init__(self, n_embd: int, width: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, width)
        self.c_proj = nn.Linear(width, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


@dataclass(frozen=True, kw_only=True)
class ModelFile:
    """``kind`` "gpt" (examples/gpt.py's GPT-2/3 with tied embeddings), "llama" (examples/llama_7b.py)
    or "llama-gqa" (examples/llama.py: grouped-query attention, as Llama 3);
    ``mlp_widths``: per captured GPT layer, its MLP width (default 4 h)."""

    kind: str
    config: object
    mlp_widths: tuple[int, ...] = ()

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
            for layer, width in zip(model.h, self.mlp_widths):
                layer.mlp = WideMLP(self.config.n_embd, width)
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


def gpt3(*, n_embd: int, n_head: int, layers: int = 2, seq_len: int = 2048, vocab_size: int = 50304,
         mlp_widths: tuple[int, ...] = ()) -> ModelFile:
    """GPT-3 (Brown et al. 2020, Table 2.1) with ``layers`` layers; the vocabulary padded to 50,304."""
    config = gpt.GPTConfig(vocab_size=vocab_size, block_size=seq_len, n_layer=layers, n_head=n_head, n_embd=n_embd)
    return ModelFile(kind="gpt", config=config, mlp_widths=mlp_widths)


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
