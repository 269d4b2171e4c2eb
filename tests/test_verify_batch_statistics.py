"""autopart verify of plans whose BatchNorms normalise by each microbatch of each replica: the
reference runs the plan's parts one forward each, so a right plan matches and a wrong one does not."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from autopart.driver import CompileOptions, compile_to_directory
from autopart.runtime.reference import train_reference
from autopart.tools.verify import verify
from tests.distributed import run_cli_here, run_ranks
from tests.test_verify import corrupt

MODEL = """
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 3, 4, 4),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
"""


def compiled(tmp_path: Path, *, pp: int, dp: int, microbatches: int) -> Path:
    """The model compiled for a global batch of 8."""
    model = tmp_path / "normed.py"
    model.write_text(MODEL)
    out = tmp_path / "out"
    plan, _ = compile_to_directory(CompileOptions(model=model, pp=pp, dp=dp, microbatches=microbatches,
                                                  micro_batch_size=8 // (dp * microbatches), measure=False), out)
    assert len(plan.batch_statistics) == 2 and plan.schedule.global_batch_size == 8
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("pp, dp, microbatches", [(2, 1, 2), (1, 2, 1), (2, 2, 2)])
def test_verify_passes_a_plan_that_normalises_by_its_parts(tmp_path, pp, dp, microbatches):
    """Each microbatch of each replica normalises by its own statistics, as DDP and pipelining do;
    one process over the whole batch normalises by the batch's, and its loss differs already at
    the first step."""
    result = run_cli_here("verify", str(compiled(tmp_path, pp=pp, dp=dp, microbatches=microbatches)), "--steps", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (f"the reference ran one forward per microbatch of each replica, {dp} x {microbatches}, as the plan does"
            in " ".join(result.stdout.split()))


@pytest.mark.multiprocess
@pytest.mark.parametrize("text, instead, failing", [
    ("True, 0.1, 1e-05", "True, 0.2, 1e-05", {"5.running_mean", "5.running_var"}),  # running statistics alone
    ("True, 0.1, 1e-05", "True, 0.1, 0.1", None),  # the normalisation itself: the loss and the gradients
])
def test_verify_still_fails_a_plan_whose_batch_norm_is_wrong(tmp_path, text, instead, failing):
    """The last stage's BatchNorm corrupted: a momentum of 0.2 moves its running statistics alone
    (training normalises by the batch's), and verify names just those; an epsilon of 0.1 changes
    what it computes, and the losses differ. The plan as compiled matches."""
    out = compiled(tmp_path, pp=2, dp=1, microbatches=2)
    intact = tmp_path / "intact"
    shutil.copytree(out, intact)
    assert verify(intact, steps=2).matches
    corrupt(out, text, instead)
    result = verify(out, steps=2)
    assert not result.matches
    named = {re.match(r"parameter (\S+) ", f).group(1) for f in result.failures if f.startswith("parameter ")}
    if failing is not None:
        assert named == failing, result.failures
    else:
        assert any(f.startswith("the loss of step 0 differs") for f in result.failures), result.failures


@pytest.mark.multiprocess
def test_the_reference_evaluates_by_the_plans_parts(tmp_path):
    """A held-out forward runs the captured BatchNorms in training mode, so the programs evaluate
    each microbatch of each replica by its own statistics: the reference's held-out loss is the
    mean over the same parts."""
    out = compiled(tmp_path, pp=2, dp=2, microbatches=2)
    metrics = tmp_path / "metrics.jsonl"
    run_ranks(out, 4, "--steps", "2", "--lr", "0.1", "--optimizer", "sgd", "--eval-every", "1",
              "--metrics", str(metrics))
    records = sorted((json.loads(line) for line in metrics.read_text().splitlines()), key=lambda r: r["step"])
    reference = train_reference(out, steps=2, lr=0.1, optimizer="sgd", eval_every=1)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records], dtype=torch.float64),
                               torch.tensor(reference.losses, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor([r["eval_loss"] for r in records], dtype=torch.float64),
                               torch.tensor([reference.eval_losses[s] for s in (0, 1)], dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.parametrize("microbatches", [2, 1])  # 1: the plan's one part is the whole batch
def test_verify_holds_adamw_on_such_a_plan_to_what_shuffled_samples_do(tmp_path, microbatches):
    """A bias before a BatchNorm has no gradient but rounding, and AdamW steps it by about the rate
    whichever way the rounding falls. Other counts of parts would train another function here, so
    the order of the sums is measured by one process over the plan's parts with each part's samples
    shuffled: the plan matches as that does; with another epsilon or momentum it does not."""
    out = compiled(tmp_path, pp=2, dp=1, microbatches=microbatches)
    result = verify(out, steps=2, lr=0.1, optimizer="adamw")
    assert result.matches, result.failures
    assert result.parameter_difference > 1e-3  # a hundred times what the rounding tolerance allows
    if microbatches == 1:  # one part: shuffled too, where other counts left no order (a right plan failed)
        return  # the cut lies elsewhere at this size: the broken plans below are the 2-part plan's
    for text, instead, failing in (("True, 0.1, 1e-05", "True, 0.1, 0.1", "the loss of step 0 differs"),
                                   ("True, 0.1, 1e-05", "True, 0.2, 1e-05", "parameter 5.running_mean")):
        broken = tmp_path / f"broken{len(failing)}"
        shutil.copytree(out, broken)
        corrupt(broken, text, instead)
        result = verify(broken, steps=2, lr=0.1, optimizer="adamw")
        assert any(f.startswith(failing) for f in result.failures), result.failures
