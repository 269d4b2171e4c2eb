"""A Llama-3-8B-shaped model: 32 layers, dim 4096, 32 heads (no grouped-query attention),
SwiGLU width 14336, a 128,256-token vocabulary (untied embedding and head), s = 8192.

Built on the meta device with two of its layers (``LAYERS`` in all): benchmarks/plan_quality.py
repeats them to full depth (``autopart.solve.repeat``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shallow import llama  # noqa: E402

LAYERS = 32
MODEL = llama(dim=4096, n_head=32, ffn_dim=14336, vocab_size=128256, seq_len=8192)
build_model, init_weights, example_batch, loss_fn = MODEL.build_model, MODEL.init_weights, MODEL.example_batch, MODEL.loss_fn
