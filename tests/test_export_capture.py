"""Models that torch.fx cannot trace (an assert on an input size, branches on shapes) are captured
with torch.export, and their generated programs train like the original model."""

import logging
import re
import textwrap

import pytest

from autopart.ir.model_file import load_model_file
from autopart.passes.capture import capture
from autopart.ir.errors import CaptureError
from tests.distributed import REPO
from tests.distributed import assert_same_training, compile_and_train

MODELS = REPO / "tests" / "models"


def test_fx_failure_falls_back_to_export_with_one_notice(caplog):
    spec = load_model_file(MODELS / "assert_size.py")
    with caplog.at_level(logging.INFO, logger="autopart"):
        graph = capture(spec, batch_size=2)
    assert graph.method == "export"
    assert graph.input_names == ("x", "target")
    notes = [r.getMessage() for r in caplog.records if r.name == "autopart"]
    assert notes == [
        "torch.fx could not trace assert_size.py (Python control flow on a traced shape or tensor at "
        "assert_size.py:32); captured it with torch.export"
    ]
    nodes = list(graph.module.graph.nodes)
    # parameters are get_attr nodes under their names in the model, the output is the loss itself
    assert {str(n.target) for n in nodes if n.op == "get_attr"} == {
        name for name, _ in spec.module.named_parameters()
    }
    assert [n.op for n in nodes].count("placeholder") == 2
    assert not any("assert_tensor_metadata" in str(n.target) for n in nodes)


def test_forced_fx_on_an_untraceable_model_is_a_capture_error():
    spec = load_model_file(MODELS / "shape_branch.py")
    with pytest.raises(CaptureError, match=r"torch\.fx could not trace shape_branch\.py: .* at shape_branch\.py:44; .*--capture export"):
        capture(spec, batch_size=2, method="fx")


def test_forced_export_on_a_traceable_model():
    graph = capture(load_model_file(REPO / "examples" / "llama.py"), batch_size=2, method="export")
    assert graph.method == "export"


SUBGRAPH_MODEL = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, h):
            h = self.linear(h)
            return {body}

    def build_model():
        return torch.nn.Sequential(Block(), Block())

    def example_batch(batch_size):
        return (torch.randn(batch_size, 8),), torch.randn(batch_size, 8)

    def loss_fn(output, target):
        return F.mse_loss(output, target)
    """
)


@pytest.mark.parametrize("body, method, message", [
    ("torch.cond(h.sum() > 0, lambda h: F.gelu(h), lambda h: F.relu(h), (h,))", "export",
     r"^the model calls torch\.cond at model\.py:13, control flow on tensor values that torch\.export keeps as "
     r"subgraphs and autopart cannot split into stages \(nor torch\.fx trace\); compute both branches and choose "
     r"with torch\.where instead$"),
    ("torch.cond(h.sum() > 0, lambda h: F.gelu(h), lambda h: F.relu(h), (h,))", None, r"^the model calls torch\.cond "),
    ("checkpoint(F.gelu, h, use_reentrant=True)", "export",
     r"^torch\.export keeps a part of forward that runs under torch\.no_grad\(\) .*use_reentrant=True.*; checkpoint "
     r"with use_reentrant=False \(or leave it to --recompute\)"),
], ids=["cond", "cond_by_default", "reentrant_checkpoint"])
def test_a_subgraph_of_the_export_names_what_made_it_and_what_to_write(tmp_path, body, method, message):
    """torch.cond and a reentrant checkpoint export as higher-order ops over subgraphs; the advice
    must lead away from them, not to the other capture (fx cannot trace torch.cond either)."""
    (tmp_path / "model.py").write_text(SUBGRAPH_MODEL.format(body=body))
    with pytest.raises(CaptureError, match=message):
        capture(load_model_file(tmp_path / "model.py"), batch_size=2, method=method)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["assert_size", "shape_branch"])
def test_exported_model_trains_like_one_process(tmp_path, model):
    run = compile_and_train(
        tmp_path, MODELS / f"{model}.py", pp=2, microbatches=2, schedule="1f1b"
    )
    assert run.plan.provenance.capture == "export"
    assert len(run.plan.stages) == 2
    source = (run.out / "stages" / "stage_0.py").read_text()
    # readable: ATen calls under module-path comments, weights under their names, no pinned device
    assert "torch.ops.aten." in source
    assert re.search(r"    # (blocks|mixers)\.0|self\.(blocks|mixers)\[0\]\)", source)  # inline, or a layer's call
    assert "device(type=" not in source
    assert_same_training(run, optimizer="sgd", lr=0.1)
