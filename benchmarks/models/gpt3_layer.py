"""One GPT-3-size Transformer layer (h = 12288, 96 heads, s = 2048) with a small vocabulary,
built on the meta device: the tensor-parallel benchmark's model."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shallow import gpt3  # noqa: E402

MODEL = gpt3(n_embd=12288, n_head=96, layers=1, vocab_size=1024)
build_model, init_weights, example_batch, loss_fn = MODEL.build_model, MODEL.init_weights, MODEL.example_batch, MODEL.loss_fn
