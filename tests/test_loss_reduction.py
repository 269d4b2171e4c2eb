"""A plan averages its microbatches' losses (and its replicas' gradients), which is the model's
loss only for a mean over the batch: a summed loss is refused where the plan splits the batch, any
other loss that is not the batch's mean is warned of (`autopart.passes.loss_reduction`)."""

import logging

import pytest
import torch
import torch.nn.functional as F

import autopart
from autopart.passes.loss_reduction import MEAN, OTHER, SUM, UNKNOWN, reduction_of

MODEL = """
import torch
import torch.nn.functional as F


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x) + 0.1 * torch.randn_like(x)  # noise drawn in forward (a VAE's sampling)


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    assert batch_size % 2 == 0, "pairs only"
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, 8, generator=g),), torch.randn(batch_size, 8, generator=g)


def loss_fn(output, target):
    return LOSS
"""
SUM_LOSS = "F.mse_loss(output, target, reduction='sum')"
IN_BATCH = "F.cross_entropy(output @ target.T, torch.arange(len(output)))"  # each sample against the batch's others


def _model(tmp_path, loss):
    path = tmp_path / "model.py"
    path.write_text(MODEL.replace("LOSS", loss))
    return path


def test_a_summed_loss_is_refused_only_where_the_plan_splits_the_batch(tmp_path):
    model = _model(tmp_path, SUM_LOSS)
    with pytest.raises(autopart.AutopartError, match=r"sums over the batch .* splits each batch of 4 into 2 of 2 and "
                                                     r"averages their losses, so it would train with gradients 1/2 "):
        autopart.compile(model, pp=1, microbatches=2, global_batch_size=4, measure=False)
    whole = autopart.compile(model, pp=1, microbatches=1, global_batch_size=4, measure=False)  # the model's own loss
    assert whole.schedule.micro_batch_size == whole.schedule.global_batch_size == 4


def test_a_loss_within_the_batch_is_warned_of_and_a_mean_is_not(tmp_path, caplog):
    """The model draws noise in its forward and its example batch takes pairs only: the check
    runs no forward of its own and asks no other batch size, so neither tells the samples apart."""
    with caplog.at_level(logging.WARNING, logger="autopart"):
        autopart.compile(_model(tmp_path, IN_BATCH), pp=1, microbatches=2, global_batch_size=4, measure=False)
    warned = [r.getMessage() for r in caplog.records if "not a mean over the batch" in r.getMessage()]
    assert len(warned) == 1 and "splits each batch of 4 into 2 of 2" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autopart"):
        autopart.compile(_model(tmp_path, "F.mse_loss(output, target)"), pp=1, microbatches=2, global_batch_size=4,
                         measure=False)
    assert not [r for r in caplog.records if "mean over the batch" in r.getMessage()]


def test_how_a_loss_reduces_over_the_batch():
    logits, labels = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))

    def tokens(output, target, **kw):
        return F.cross_entropy(output.reshape(-1, 7), target.reshape(-1), **kw)

    assert reduction_of(tokens, logits, labels) == MEAN
    assert reduction_of(tokens, logits.bfloat16(), labels) == MEAN  # 16-bit rounding is no reduction
    assert reduction_of(lambda o, t: tokens(o, t, reduction="sum"), logits, labels) == SUM
    assert reduction_of(lambda o, t: tokens(o, t, reduction="sum"), logits[:1], labels[:1]) == SUM  # one sample, twice
    uneven = labels.clone()
    uneven[0, :3] = -100  # sample 0 counts 2 tokens, sample 1 counts 5: the batch's mean is no mean of theirs
    assert reduction_of(tokens, logits, uneven) == OTHER
    assert reduction_of(None, logits, labels) == UNKNOWN  # the model returns its loss
    assert reduction_of(lambda o, t: o[1].mean(), logits, labels) == UNKNOWN  # needs a second sample
    assert reduction_of(lambda o, t: tokens(o["logits"], t["labels"]), {"logits": logits}, {"labels": labels}) == MEAN
