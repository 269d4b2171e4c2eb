"""Attention is split over the batch or the heads, never over the sequence: a query attends to
every key, so a rank holding a slice of the sequence would attend to its own keys only. The
three-dimensional form of ``scaled_dot_product_attention`` has the sequence at dim 1."""

import pytest

from autopart.ir.model_file import load_model_file
from autopart.ir.placement import REPLICATE, shard
from autopart.passes.annotate import annotate
from autopart.passes.capture import capture
from autopart.solve.sharding_rules import strategies
from cost_models import get_cost_model

MODEL = """\
import torch
from torch.nn import functional as F

class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4).reshape(3, b * 4, s, 8).unbind(0)
        {attention}
        return out.reshape(b, 4, s, 8).transpose(1, 2).reshape(b, s, 32)

def build_model():
    return Attention()

def example_batch(b):
    return (torch.randn(b, 16, 32),), torch.randn(b, 16, 32)

def loss_fn(out, target):
    return ((out - target) ** 2).mean()
"""


@pytest.mark.parametrize("dims", [3, 4])
def test_attention_is_never_split_over_the_sequence(tmp_path, dims):
    attention = ("out = F.scaled_dot_product_attention(q, k, v, is_causal=True)" if dims == 3 else
                 "out = F.scaled_dot_product_attention(q.reshape(b, 4, s, 8), k.reshape(b, 4, s, 8), "
                 "v.reshape(b, 4, s, 8), is_causal=True)")
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(attention=attention))
    spec = load_model_file(path)
    op_graph = annotate(capture(spec, batch_size=2), spec, get_cost_model("h100-sxm"), micro_batch_size=2)
    node = next(n for n in op_graph.graph.module.graph.nodes if "scaled_dot_product_attention" in str(n.target))
    outputs = {strategy.output for strategy in strategies(node, op_graph, 2)}
    assert shard(0) in outputs and shard(dims - 2) not in outputs, outputs
    assert outputs <= {REPLICATE, *(shard(d) for d in range(dims - 2))}, outputs
