"""The stage programs as a reader sees them: names, attribute paths, clears, layers written once,
and cuts that carry the residual stream alone."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import fx

import autopart
from autopart.passes.annotate import annotate
from autopart.passes.blocks import build_blocks
from autopart.ir.model_file import eager_loss, load_model_file
from autopart.passes.capture import capture
from autopart.codegen.program import Expressions, Memory, Step, attribute_path, function_lines
from autopart.runtime.reference import initial_weights
from autopart.runtime.stage import load_stage
from cost_models import get_cost_model
from tests.distributed import REPO
from tests.stage_chain import chained_loss


def test_attribute_paths_index_numbered_children_and_fall_back_to_getattr():
    everywhere = lambda path: True  # noqa: E731
    assert attribute_path("self", "layers.0.attention.wq.weight", indexable=everywhere) == "self.layers[0].attention.wq.weight"
    assert attribute_path("self", "blocks.0.w", indexable=lambda path: path != "blocks") == 'getattr(self.blocks, "0").w'.replace('"', "'")
    assert attribute_path("layer", "mlp.class.b-1", indexable=everywhere) == "getattr(getattr(layer.mlp, 'class'), 'b-1')"


def test_functions_are_written_under_their_public_names():
    graph = fx.Graph()
    x = graph.placeholder("x")
    w = graph.placeholder("w")
    calls = [
        graph.call_function(torch._C._nn.linear, (x, w, None)),
        graph.call_function(torch._C._nn.scaled_dot_product_attention, (x, x, x), {"is_causal": True}),
        graph.call_function(torch.rsqrt, (x,)),
        graph.call_function(F.silu, (x,), {"inplace": False}),
        graph.call_function(getattr, (x, "shape")),
        graph.call_function(torch.ops.aten.mm.default, (x, w)),
    ]
    expressions = Expressions(variable=lambda node: node.name, attribute=lambda node: f"self.{node.target}")
    written = [expressions.of(node) for node in calls]
    assert written == [
        "F.linear(x, w)", "F.scaled_dot_product_attention(x, x, x, is_causal=True)", "torch.rsqrt(x)", "F.silu(x)",
        "x.shape", "torch.ops.aten.mm.default(x, w)",
    ]  # fmt: skip
    assert expressions.imports == {"import torch.nn.functional as F"}


def clears(steps: list[Step], sizes: dict[str, int], roots: dict[str, str] | None = None) -> list[str]:
    memory = Memory(sizes=sizes, roots=roots or {}, threshold=10)
    lines = function_lines("def f(self, x):", steps, parameters={"x"}, memory=memory, variable=str)
    return [line.strip() for line in lines if line.strip().startswith("del ")]


def test_a_value_is_cleared_only_where_a_large_op_follows_and_it_is_large():
    steps = [
        Step(defines="a", text="a = x * 2", uses=("x",), large=False),
        Step(defines="small", text="small = a.sum(-1)", uses=("a",), large=False),
        Step(defines="b", text="b = F.linear(a, w)", uses=("a", "small"), large=True),
        Step(defines="c", text="c = F.linear(b, w)", uses=("b",), large=True),
        Step(defines="d", text="d = c + 1", uses=("c",), large=False),
        Step(defines=None, text="return d", uses=("d",), large=False),
    ]
    sizes = {"a": 100, "small": 1, "b": 100, "c": 100, "d": 100}
    # a dies before c's linear: cleared; small is too small to be worth a line; b, c and d die
    # after the last large op, where the frame's return frees them anyway; x is the caller's
    assert clears(steps, sizes) == ["del a"]


def test_a_view_keeps_its_storage_alive_so_the_clear_waits_for_it():
    steps = [
        Step(defines="a", text="a = F.linear(x, w)", uses=("x",), large=True),
        Step(defines="v", text="v = a.view(-1)", uses=("a",), large=False),
        Step(defines="b", text="b = v * 2", uses=("v",), large=False),
        Step(defines="c", text="c = F.linear(b, w)", uses=("b",), large=True),
        Step(defines=None, text="return c", uses=("c",), large=False),
    ]
    sizes = {"a": 100, "v": 100, "b": 100, "c": 100}
    assert clears(steps, sizes, roots={"v": "a"}) == ["del a, v"]


def test_every_cut_of_the_examples_carries_the_residual_stream_alone():
    """No cut inside a norm: a point where an RMSNorm's rsqrt is live beside the stream is no cut.
    (After the final norm its output alone crosses, the stream's last form before the head.)"""
    for example in ("llama", "gpt"):
        spec = load_model_file(REPO / "examples" / f"{example}.py")
        graph = capture(spec, batch_size=2)
        chain = build_blocks(annotate(graph, spec, get_cost_model("a100-80gb"), micro_batch_size=2))
        assert len(chain.boundaries) >= 8, example  # two per layer: after attention, after the MLP
        for boundary in chain.boundaries:
            (name, meta), = boundary.tensors
            assert not name.startswith(("rsqrt", "mean", "pow")), (example, name)
            assert meta.shape[-1] == 64, (example, name, meta)  # the model's width: the stream


SHARED = '''
import torch
from torch import nn
import torch.nn.functional as F


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            source = self.layers[i - 1] if i % 2 else layer  # odd layers read the previous one's weight
            x = x + torch.tanh(F.linear(x, source.lin.weight, layer.lin.bias))
        return x.pow(2).mean()


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    return (torch.randn(batch_size, 16),), None


def loss_fn(output, target):
    return output
'''


def run_stages(out: Path, plan, inputs: tuple, target) -> torch.Tensor:
    """The emitted stages loaded as a rank loads them and chained in this process: the loss."""
    return chained_loss([load_stage(out, s.index, torch.device("cpu")) for s in plan.stages], plan, inputs, target)


def test_layers_that_differ_in_what_they_read_are_written_inline_and_compute_the_model(tmp_path):
    model = tmp_path / "shared.py"
    model.write_text(textwrap.dedent(SHARED))
    plan = autopart.compile(model, pp=2, microbatches=2, device="a100-80gb")
    out = autopart.emit(plan, tmp_path / "out")
    sources = [(out / "stages" / f"stage_{s.index}.py").read_text() for s in plan.stages]
    # layer 1 reads layer 0's weight and layer 3 layer 2's: each is written apart from the layer before it
    assert "F.linear(x, layer[0].lin.weight, layer[1].lin.bias)" in sources[0]
    assert "F.linear(x, self.layers[2].lin.weight, self.layers[3].lin.bias)" in sources[1]
    spec = load_model_file(model)
    spec.module.load_state_dict(initial_weights(out), strict=False)
    inputs, target = spec.example(plan.schedule.micro_batch_size)
    torch.testing.assert_close(run_stages(out, plan, inputs, target), eager_loss(spec, inputs, target))
