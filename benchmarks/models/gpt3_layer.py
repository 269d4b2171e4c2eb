"""One GPT-3-size Transformer layer (h = 12288, 96 heads, s = 2048) with a small vocabulary,
built on the meta device: the tensor-parallel benchmark's model."""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402

gpt.CONFIG = gpt.GPTConfig(vocab_size=1024, block_size=2048, n_layer=1, n_head=96, n_embd=12288)
example_batch, loss_fn = gpt.example_batch, gpt.loss_fn


def build_model() -> nn.Module:
    with torch.device("meta"):
        return gpt.GPT(gpt.CONFIG)


def init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
