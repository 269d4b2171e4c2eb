"""A Llama-3-70B-shaped model: 80 layers, dim 8192, 64 heads over 8 key/value heads, SwiGLU width 28672, a
128,256-token vocabulary (untied embedding and head), s = 8192 (Grattafiori et al. 2024, Table 3).

Built on the meta device with two of its layers (``LAYERS`` in all): benchmarks/plan_quality.py
repeats them to full depth (``autopart.solve.repeat``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shallow import llama3  # noqa: E402

LAYERS = 80
MODEL = llama3(dim=8192, n_head=64, n_kv_head=8, ffn_dim=28672, seq_len=8192)
build_model, init_weights, example_batch, loss_fn = MODEL.build_model, MODEL.init_weights, MODEL.example_batch, MODEL.loss_fn
