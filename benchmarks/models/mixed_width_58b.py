"""A larger GPT whose layers differ in width: 8 layers with the usual 4h MLP, then 40 with a 16h
MLP (h = 6144, 48 heads, s = 2048; 58B parameters), the layout of models that keep their first
layers dense and widen the rest. Large enough that its weights and optimizer state do not fit
on a node without a pipeline, so the cuts decide the step.

Built on the meta device with one layer of each kind: benchmarks/plan_quality.py repeats the
first 8 times and the second 40 (``autopart.solve.repeat``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shallow import gpt3  # noqa: E402

LAYERS = 48
MODEL = gpt3(n_embd=6144, n_head=48, mlp_widths=(4 * 6144, 16 * 6144))
build_model, init_weights, example_batch, loss_fn = MODEL.build_model, MODEL.init_weights, MODEL.example_batch, MODEL.loss_fn
