"""Capturing a deep model costs what its layers' count makes necessary, and no more: fx's
attribute reads found by a table (not a scan of every parameter per read), and a meta model's
eager check run through two of its layers, with the same errors."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from autopart.ir.model_file import load_model_file
from autopart.passes.capture import capture
from autopart.ir.errors import ModelFileError
from tests.distributed import REPO

DEEP = '''
import sys
sys.path.insert(0, {models!r})
from shallow import gpt3
MODEL = gpt3(n_embd=64, n_head=4, layers=12, seq_len=16, vocab_size=128)
build_model, init_weights, loss_fn = MODEL.build_model, MODEL.init_weights, MODEL.loss_fn


def example_batch(batch_size):
    inputs, target = MODEL.example_batch(batch_size)
    return (inputs[0]{index},), target
'''


class _Through(fx.Tracer):
    """fx's own tracer, into every module, as autopart traces."""

    def is_leaf_module(self, module, qualified_name) -> bool:
        return False


def deep_model(tmp_path, index: str = ""):
    path = tmp_path / f"deep_{len(index)}.py"
    path.write_text(DEEP.format(models=str(REPO / "benchmarks" / "models"), index=index))
    return load_model_file(path)


def test_the_graph_reads_each_weight_once_as_fx_would(tmp_path) -> None:
    spec = deep_model(tmp_path)
    graph = capture(spec, batch_size=2).module.graph
    ours = [str(n.target) for n in graph.nodes if n.op == "get_attr"]
    theirs = [str(n.target) for n in _Through().trace(spec.module).nodes if n.op == "get_attr"]
    assert ours == theirs and "wte.weight" in ours  # the tied head reads the embedding by its first name
    assert len(ours) == len(set(ours))


def test_a_deep_meta_model_is_checked_through_two_layers(tmp_path, monkeypatch) -> None:
    spec = deep_model(tmp_path)
    assert next(spec.module.parameters()).is_meta and len(spec.module.h) == 12
    ran = []
    block = type(spec.module.h[0])
    forward = block.forward
    monkeypatch.setattr(block, "forward", lambda self, x: ran.append(1) or forward(self, x))
    monkeypatch.setattr(fx.Tracer, "trace", lambda self, *a, **k: pytest.skip("only the eager check is counted"))
    with pytest.raises(pytest.skip.Exception):
        capture(spec, batch_size=2, method="fx")
    assert len(ran) == 2


def test_a_deep_meta_model_that_rejects_its_batch_still_says_so(tmp_path) -> None:
    spec = deep_model(tmp_path, index="[..., None]")  # (B, T, 1) token ids: the model takes (B, T)
    with pytest.raises(ModelFileError, match="rejects its own example batch"):
        capture(spec, batch_size=2)


def test_a_capture_rewritten_in_place_runs_its_rewritten_graph() -> None:
    """The captured module writes its Python code when first run, not when made or rewritten
    (the compiler only reads the graph): a rewrite made after the capture (biases as ops of their
    own, for tensor parallelism) is what runs, and computes the model's loss."""
    from autopart.ir.model_file import eager_loss
    from autopart.passes.capture import graph_args
    from autopart.passes.rewrite import separate_biases

    spec = load_model_file(REPO / "examples" / "gpt.py")
    graph = capture(spec, batch_size=2)
    rewritten = separate_biases(graph)
    added = [n for n in rewritten.module.graph.nodes if n.op == "call_method" and n.target == "type_as"]
    assert added and "type_as" in rewritten.module.code  # the code read is the rewritten graph's
    inputs, target = spec.example(2)
    with torch.no_grad():
        got = rewritten.module(*graph_args(rewritten, inputs, target))
    assert torch.allclose(got, eager_loss(spec, inputs, target), rtol=1e-5, atol=1e-6)


SPLIT = '''
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x):
        y = self.lin(x)
{body}


def build_model():
    return M()


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),), torch.zeros(batch_size)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()
'''


@pytest.mark.parametrize(("body", "method"), [
    ("        a, b, c = y.split(2, dim=1)\n        return a.sum(1) * b.sum(1) - c.sum(1)", "fx"),  # unpacked: traced
    ("        return sum(part.sum(1) for part in y.split(2, dim=1))", "export"),  # iterated: fx refuses
])
def test_a_traced_value_unpacks_where_the_line_unpacks_it_and_is_refused_elsewhere(tmp_path, body, method) -> None:
    """fx's tracer iterates a traced value only where the calling line unpacks it (it reads how
    many values from the line's bytecode, here from a table made once per function); elsewhere
    it refuses, naming the line, and the default capture falls back to torch.export."""
    from autopart.ir.errors import CaptureError

    path = tmp_path / "split.py"
    path.write_text(SPLIT.format(body=body))
    spec = load_model_file(path)
    assert capture(spec).method == method
    if method == "export":
        with pytest.raises(CaptureError, match=r"split\.py:13"):
            capture(spec, method="fx")
