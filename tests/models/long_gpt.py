"""examples/gpt.py's GPT with a long sequence and a narrow width: its activations outweigh its
parameters many times, so activation recompute decides what fits."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_gpt import gpt, gpt_model_file  # noqa: E402

CONFIG = gpt.GPTConfig(vocab_size=128, block_size=1024, n_layer=4, n_head=8, n_embd=64)
build_model, example_batch, loss_fn = gpt_model_file(CONFIG)
