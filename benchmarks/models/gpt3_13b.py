"""GPT-3 13B (Brown et al. 2020, Table 2.1): 40 layers, h = 5140 (5120 here, a multiple of the 40 heads), s = 2048.

Built on the meta device with two of its layers (``LAYERS`` in all): benchmarks/plan_quality.py
repeats them to full depth (``autopart.solve.repeat``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shallow import gpt3  # noqa: E402

LAYERS = 40
MODEL = gpt3(n_embd=5120, n_head=40)
build_model, init_weights, example_batch, loss_fn = MODEL.build_model, MODEL.init_weights, MODEL.example_batch, MODEL.loss_fn
