"""The helpers of benchmarks/runtime_vs_torch.py that fit autopart's stages to torch's pipelining API."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "runtime_vs_torch.py"
_spec = importlib.util.spec_from_file_location("runtime_vs_torch", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.modules["runtime_vs_torch"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


class LastStage(nn.Module):
    """Shaped like a generated last stage: received tensors first, then batch values by name."""

    def forward(self, add_5, target):
        return torch.nn.functional.cross_entropy(add_5, target)


def test_batch_values_reach_the_stage_by_their_names():
    graph_inputs = ("idx", "target")
    idx, target = torch.zeros(4, 3, dtype=torch.long), torch.tensor([0, 1, 2, 1])
    keywords = bench.batch_keywords(graph_inputs, (idx, target), ("target",))
    assert list(keywords) == ["batch_target"] and keywords["batch_target"] is target

    received = torch.randn(4, 3)
    wrapped = bench.BatchByKeyword(LastStage(), ("target",))
    loss = wrapped(received, **keywords)
    torch.testing.assert_close(loss, LastStage()(received, target))
    assert bench.loss_is_the_output(loss, target) is loss


def test_runs_that_train_differently_are_refused():
    run = bench.Run(step_s=0.1, losses=[1.0, 0.9])
    assert bench.same_losses([run], [bench.Run(step_s=0.2, losses=[1.0, 0.9, 0.8])]) == 0.0
    with pytest.raises(RuntimeError, match="do not compute the same step"):
        bench.same_losses([run], [bench.Run(step_s=0.1, losses=[1.0, 0.8])])


def test_table_is_markdown():
    assert bench.table(["a", "b"], [["1", "2"]]).splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |"]
