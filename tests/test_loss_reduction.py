"""A plan averages its microbatches' losses (and its replicas' gradients), which is the model's
loss only for a mean over the batch: a summed loss is refused where the plan splits the batch, any
other loss that is not the batch's mean is warned of (`autopart.passes.loss_reduction`)."""

import logging

import pytest
import torch

import autopart
from autopart.ir.model_file import load_model_file
from autopart.passes.loss_reduction import check_mean_loss

MODEL = """
import torch
import torch.nn.functional as F


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return self.drop(self.linear(x))


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, 8, generator=g),), torch.randn(batch_size, 8, generator=g)


def loss_fn(output, target):
    return LOSS
"""
SUM = "F.mse_loss(output, target, reduction='sum')"
IN_BATCH = "F.cross_entropy(output @ target.T, torch.arange(len(output)))"  # each sample against the batch's others


def _model(tmp_path, loss):
    path = tmp_path / "model.py"
    path.write_text(MODEL.replace("LOSS", loss))
    return path


def test_a_summed_loss_is_refused_only_where_the_plan_splits_the_batch(tmp_path):
    model = _model(tmp_path, SUM)
    with pytest.raises(autopart.AutopartError, match=r"sums over the batch .* so it would train with gradients 1/2 "):
        autopart.compile(model, pp=1, microbatches=2, global_batch_size=4, measure=False)
    whole = autopart.compile(model, pp=1, microbatches=1, global_batch_size=4, measure=False)  # the model's own loss
    assert whole.schedule.micro_batch_size == whole.schedule.global_batch_size == 4


def test_a_loss_within_the_batch_is_warned_of_and_a_mean_is_not(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="autopart"):
        autopart.compile(_model(tmp_path, IN_BATCH), pp=1, microbatches=2, global_batch_size=4, measure=False)
    warned = [r.getMessage() for r in caplog.records if "not a mean over the batch" in r.getMessage()]
    assert len(warned) == 1 and "splits each batch of 4 into 2 of 2" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autopart"):
        autopart.compile(_model(tmp_path, "F.mse_loss(output, target)"), pp=1, microbatches=2, global_batch_size=4,
                         measure=False)
    assert not [r for r in caplog.records if "mean over the batch" in r.getMessage()]


def test_the_check_leaves_the_model_as_it_found_it(tmp_path):
    """Run in eval mode, so that dropout and batch statistics do not tell the halves apart: the
    training flags, the buffers a forward advances and the caller's random state are put back."""
    spec = load_model_file(_model(tmp_path, "F.mse_loss(output, target)"))
    plan = autopart.compile(spec.path, pp=1, microbatches=2, global_batch_size=4, measure=False)
    spec.module.drop.eval()  # one submodule's own flag, which module.train() would overwrite
    calls = spec.module.calls.clone()
    state = torch.get_rng_state()
    check_mean_loss(spec, plan)
    assert spec.module.training and not spec.module.drop.training and spec.module.linear.training
    assert torch.equal(spec.module.calls, calls) and torch.equal(torch.get_rng_state(), state)
