"""GPT-3 XL, 1.3B parameters (Brown et al. 2020, Table 2.1): 24 layers, h = 2048, 16 heads, s = 2048.

Built on the meta device with two of its layers (``LAYERS`` in all): benchmarks/plan_quality.py
repeats them to full depth (``autopart.solve.repeat``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shallow import gpt3  # noqa: E402

LAYERS = 24
MODEL = gpt3(n_embd=2048, n_head=16)
build_model, init_weights, example_batch, loss_fn = MODEL.build_model, MODEL.init_weights, MODEL.example_batch, MODEL.loss_fn
