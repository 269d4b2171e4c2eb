"""A GPT wide enough (4 MB of weights, 1.8 MB a layer) that a stage's gradients fill more than one
data-parallel bucket: the first (1 MiB) is reduced while the backward is still running."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402

gpt.CONFIG = gpt.GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=192)
build_model, example_batch, loss_fn = gpt.build_model, gpt.example_batch, gpt.loss_fn
