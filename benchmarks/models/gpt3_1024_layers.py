"""GPT-3 175B's layer (h = 12288, 96 heads, s = 2048) 1,024 times: a 1.9T-parameter model, built
whole on the meta device (benchmarks/solver_scale.py compiles it)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shallow import gpt3  # noqa: E402

MODEL = gpt3(n_embd=12288, n_head=96, layers=1024)
build_model, init_weights, example_batch, loss_fn = MODEL.build_model, MODEL.init_weights, MODEL.example_batch, MODEL.loss_fn
