"""examples/gpt.py's GPT with two layers of width 32: small enough to compile in seconds."""

import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402


def gpt_model_file(config: "gpt.GPTConfig"):
    """The model-file functions (build_model, example_batch, loss_fn) of a GPT of ``config``."""

    def build_model():
        torch.manual_seed(0)
        return gpt.GPT(config)

    def example_batch(batch_size: int):
        generator = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=generator)
        return (tokens[:, :-1],), tokens[:, 1:]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return build_model, example_batch, loss_fn


CONFIG = gpt.GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)
build_model, example_batch, loss_fn = gpt_model_file(CONFIG)
