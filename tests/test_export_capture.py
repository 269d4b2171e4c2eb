"""Models that torch.fx cannot trace (an assert on an input size, branches on shapes) are captured
with torch.export, and their generated programs train like the original model."""

import logging

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
    assert "    # blocks.0" in source or "    # mixers.0" in source
    assert "device(type=" not in source
    assert_same_training(run, optimizer="sgd", lr=0.1)
