"""examples/gpt.py's GPT with a long sequence and a narrow width: its activations (attention
scores above all) outweigh its parameters many times, so activation recompute decides what fits."""

import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402

CONFIG = gpt.GPTConfig(vocab_size=128, block_size=1024, n_layer=4, n_head=8, n_embd=64)


def build_model():
    torch.manual_seed(0)
    return gpt.GPT(CONFIG)


def example_batch(batch_size: int):
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.block_size + 1), generator=generator)
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
