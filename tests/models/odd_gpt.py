"""A GPT whose hidden size (45) is odd and whose head count (3) no even TP degree divides."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402

gpt.CONFIG = gpt.GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=3, n_embd=45)
build_model, example_batch, loss_fn = gpt.build_model, gpt.example_batch, gpt.loss_fn
