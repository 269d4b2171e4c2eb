"""A deep model's annotation read off its shallow copy's (autopart/passes/repeat_annotation.py)
is the annotation the model gets for real, node by node; graphs that are not the copy's layers
repeated are annotated for real."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopart.ir.model_file import load_model_file
from autopart.options import CompileOptions
from autopart.passes import front as front_passes
from autopart.passes.front import annotated, capture_for
from autopart.passes.repeat_annotation import LAID_OUT_FROM, laid_out
from autopart.passes.shallow import repeated_layers, shallow_module
from autopart.solve import planner
from tests.test_tp_families import model_file

ODD_LAYERS = '''
import torch
from torch import nn
import torch.nn.functional as F


class Layer(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.index = index
        self.fc = nn.Linear(16, 16)

    def forward(self, x, first):
        y = x + self.fc(x)
        {body}
        return y


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(Layer(i) for i in range(9))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        outputs = [x]
        for layer in self.layers:
            x = layer(x, {feed})
            outputs.append(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    tokens = torch.randint(0, 32, (batch_size, 8), generator=torch.Generator().manual_seed(0))
    return (tokens,), tokens


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))
'''


def _both(path, *, tp: int, dtype: str, size: int = 2, leaf: tuple[str, ...] = ()):
    """The full model's real annotation, and the one laid out from its shallow copy's."""
    options = CompileOptions(model=path, device="h100-sxm", tp=tp, dtype=dtype, leaf=leaf)
    spec = load_model_file(path)
    layers = repeated_layers(spec.module)
    assert layers is not None and layers.count == 9
    real = annotated(options, size, separate_biases=tp > 1, spec=spec).op_graph
    copy = annotated(options, size, separate_biases=tp > 1,
                     spec=replace(spec, module=shallow_module(spec.module, layers, LAID_OUT_FROM))).op_graph
    graph = capture_for(spec, tp, batch_size=size, method=options.capture, leaves=options.leaf)
    return real, laid_out(graph, copy, layers.path)


@pytest.mark.parametrize("family", ["gpt", "llama", "plain_gpt"])
def test_the_laid_out_annotation_is_the_real_one_node_by_node(tmp_path, family) -> None:
    path = model_file(tmp_path, family, layers=9, width=32, heads=4, kv_heads=2)  # llama: grouped-query
    forms = [(1, "fp32", ()), (2, "bf16", ())]
    if family == "gpt":
        forms.append((1, "fp32", ("MLP",)))  # a module kept whole (--leaf): its weights named by their layer too
    for tp, dtype, leaf in forms:
        real, laid = _both(path, tp=tp, dtype=dtype, leaf=leaf)
        assert laid is not None, (family, tp, dtype, leaf)
        assert list(laid.nodes) == list(real.nodes)
        assert [n for n in real.nodes if laid.nodes[n] != real.nodes[n]] == []
        assert laid.kernels == real.kernels and laid.leaf_tensors == real.leaf_tensors
        assert (laid.micro_batch_size, laid.dtype, laid.cost_model) == (real.micro_batch_size, real.dtype, real.cost_model)
        assert laid.graph.module.graph is not real.graph.module.graph  # the full capture's own graph


@pytest.mark.parametrize("body, feed, alike", [
    ("y = y * 2 if self.index == 5 else y", "outputs[0]", False),  # one layer's graph differs from the others'
    ("y = y + first", "outputs[max(len(outputs) - 3, 0)]", False),  # three layers back: the copy cannot hold that
    ("y = y + first", "outputs[max(len(outputs) - 2, 0)]", True),  # two back: the copy's last reads its first
    # the first layer saves its output, the others not: the second layer is charged nothing for its
    # input, every later one is (the copy's last two layers disagree)
    ("y = torch.tanh(y) if self.index == 0 else y * 2.0", "outputs[0]", False),
    ("y = y + first", "outputs[0]", True),  # every layer reads the embedding's output
    ("y = y * first", "outputs[0]", True),  # and saves it: charged to the first layer alone
    ("y = y + 0 * x", "outputs[0]", True),
])  # fmt: skip
def test_layers_whose_graphs_differ_are_annotated_for_real(tmp_path, body, feed, alike) -> None:
    path = tmp_path / "odd.py"
    path.write_text(ODD_LAYERS.format(body=body, feed=feed))
    real, laid = _both(path, tp=1, dtype="fp32")
    if alike:
        assert laid is not None and laid.nodes == real.nodes and laid.kernels == real.kernels
    else:
        assert laid is None


def test_the_search_lays_the_full_model_out_and_plans_as_when_annotating_it(tmp_path, monkeypatch) -> None:
    path = model_file(tmp_path, "gpt", layers=9, width=32, heads=4)
    options = CompileOptions(model=path, world_size=4, global_batch_size=8, device="h100-sxm")
    full_annotations = []
    real_annotate = front_passes.annotate

    def annotate(graph, *args, **kwargs):
        full_annotations.append(any(str(n.target).startswith("h.8.") for n in graph.module.graph.nodes))
        return real_annotate(graph, *args, **kwargs)

    monkeypatch.setattr(front_passes, "annotate", annotate)
    laid = planner.plan_by_search(options).plan
    assert full_annotations and not any(full_annotations)  # the copy annotated, the full model laid out
    full_annotations.clear()
    monkeypatch.setattr(planner.FrontTable, "lay_out_from", lambda self, shallow, path: None)  # annotated for real
    real = planner.plan_by_search(options).plan
    assert any(full_annotations)
    assert laid.stages == real.stages and laid.predicted == real.predicted and laid.mesh == real.mesh
