"""A GPT whose layers differ in width (16B parameters): 8 layers with the usual 4h MLP, then 24 with a 16h MLP
(h = 4096, 32 heads, s = 2048), the layout of models that keep their first layers dense and
widen the rest (DeepSeek-V2/V3 keep their first layers dense and make the rest MoE).
The file has one layer of each kind; plan_quality repeats the first 8 times and the second 24.

Built on the meta device with two of its layers (``LAYERS`` in all): benchmarks/plan_quality.py
repeats them to full depth (``autopart.solve.repeat``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shallow import gpt3  # noqa: E402

LAYERS = 32
MODEL = gpt3(n_embd=4096, n_head=32, mlp_widths=(4 * 4096, 16 * 4096))
build_model, init_weights, example_batch, loss_fn = MODEL.build_model, MODEL.init_weights, MODEL.example_batch, MODEL.loss_fn
