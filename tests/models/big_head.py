"""A GPT whose vocabulary head costs as much as several of its layers: cuts must balance time."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402

gpt.CONFIG = gpt.GPTConfig(vocab_size=8192, block_size=32, n_layer=8, n_head=4, n_embd=64)
build_model, example_batch, loss_fn = gpt.build_model, gpt.example_batch, gpt.loss_fn
