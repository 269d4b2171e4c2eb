"""BatchNorm in training normalises by its batch, and a pipeline's batch is a microbatch: the
compile says so where the microbatch is smaller than the global batch, whichever capture ran."""

import pytest
import torch
from safetensors.torch import load_file

import autopart

MODEL = """
import torch
from safetensors.torch import load_file
from torch import nn


class Normed(nn.Module):  # batch statistics alone, as torch.fx traces them (nn.BatchNorm1d it cannot)
    def forward(self, x):
        return nn.functional.batch_norm(x, None, None, training=True)


def build_model():
    torch.manual_seed(0)
    norm = NORM
    return nn.Sequential(nn.Linear(8, 16), norm(), nn.ReLU(), nn.Linear(16, 16), norm(), nn.ReLU(), nn.Linear(16, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
"""


def test_a_batch_norm_in_eval_mode_is_not_noted(tmp_path, caplog):
    """A BatchNorm kept in eval mode (a fine-tune's frozen statistics) normalises by its running
    statistics, whatever the microbatch."""
    model = tmp_path / "bn.py"
    model.write_text(MODEL.replace("NORM", "lambda: nn.BatchNorm1d(16).eval()"))
    with caplog.at_level("INFO", logger="autopart"):
        plan = autopart.compile(model, pp=2, microbatches=4, global_batch_size=8, capture="export", measure=False)
    assert "BatchNorm" not in caplog.text
    assert plan.batch_statistics == ()  # verify's reference runs the whole batch in one forward


@pytest.mark.parametrize("capture, norm", [("fx", "Normed"), ("export", "lambda: nn.BatchNorm1d(16)")])
def test_batch_norm_over_microbatches_is_noted(tmp_path, caplog, capture, norm):
    model = tmp_path / "bn.py"
    model.write_text(MODEL.replace("NORM", norm))
    with caplog.at_level("INFO", logger="autopart"):
        plan = autopart.compile(model, pp=2, microbatches=4, global_batch_size=8, capture=capture, measure=False)
    assert "2 BatchNorm op(s) normalise by the statistics of each microbatch of 2 samples, not of the global batch " \
           "of 8" in caplog.text
    assert "autopart verify's reference splits the batch as the plan does" in caplog.text
    assert len(plan.batch_statistics) == 2
    caplog.clear()
    with caplog.at_level("INFO", logger="autopart"):
        autopart.compile(model, pp=2, microbatches=1, global_batch_size=8, capture=capture, measure=False)
    assert "BatchNorm" not in caplog.text


def test_the_running_statistics_are_emitted_as_built(tmp_path):
    """The capture's checks and annotate's timing run forwards in training mode, which move
    BatchNorm's running statistics; the weights written start where build_model() started them,
    as the reference run does."""
    from safetensors.torch import load_file

    model = tmp_path / "bn.py"
    model.write_text(MODEL.replace("NORM", "lambda: nn.BatchNorm1d(16)"))
    out = tmp_path / "out"
    autopart.emit(autopart.compile(model, pp=2, microbatches=4, global_batch_size=8, measure=False), out)
    weights = {**load_file(str(out / "weights" / "stage_0.safetensors")),
               **load_file(str(out / "weights" / "stage_1.safetensors"))}
    means = [value for name, value in weights.items() if name.endswith("running_mean")]
    variances = [value for name, value in weights.items() if name.endswith("running_var")]
    assert len(means) == len(variances) == 2
    assert all(torch.equal(m, torch.zeros(16)) for m in means) and all(torch.equal(v, torch.ones(16)) for v in variances)


def test_a_batch_norm_inside_a_leaf_module_is_noted(tmp_path, caplog):
    """A --leaf module is traced whole, its ops unseen: the BatchNorm modules it holds in training
    are what say it normalises by its microbatch."""
    model = tmp_path / "bn.py"
    model.write_text(MODEL.replace("NORM", "Block").replace("class Normed", """class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x):
        return self.norm(x)


class Normed"""))
    with caplog.at_level("INFO", logger="autopart"):
        plan = autopart.compile(model, pp=2, microbatches=4, global_batch_size=8, leaf=("Block",), measure=False)
    assert "2 BatchNorm op(s) normalise by the statistics of each microbatch of 2 samples" in caplog.text
    assert len(plan.batch_statistics) == 2  # the calls of the two Block modules


@pytest.mark.multiprocess
def test_an_evaluation_leaves_the_running_statistics_as_training_left_them(tmp_path):
    """A held-out forward runs the captured BatchNorms in training mode, which moved their running
    statistics by the held-out batches: --eval-every changed the model trained (the reference's
    eager evaluation likewise). The weights saved with and without evaluations are the same."""
    from autopart.runtime.reference import train_reference
    from tests.distributed import run_ranks

    model = tmp_path / "bn.py"
    model.write_text(MODEL.replace("NORM", "lambda: nn.BatchNorm1d(16)"))
    out = tmp_path / "out"
    autopart.emit(autopart.compile(model, pp=2, microbatches=2, global_batch_size=4, capture="export", measure=False),
                  out)  # fmt: skip
    saved = {}
    for name, evaluation in (("plain", []), ("evaluated", ["--eval-every", "1"])):
        run_ranks(out, 2, "--steps", "2", "--save-weights", str(tmp_path / name), *evaluation)
        saved[name] = {k: v for stage in (0, 1) for k, v in
                       load_file(str(tmp_path / name / f"stage_{stage}.safetensors")).items()}  # fmt: skip
    assert any("running_mean" in name for name in saved["plain"])
    for name, value in saved["plain"].items():
        assert torch.equal(value, saved["evaluated"][name]), name
    plain, evaluated = (train_reference(out, steps=2, lr=0.1, optimizer="sgd", eval_every=every)
                        for every in (0, 1))  # fmt: skip
    for name, value in plain.parameters.items():
        assert torch.equal(value, evaluated.parameters[name]), name


def test_a_cumulative_batch_norm_kept_whole_compiles(tmp_path):
    """momentum=None is refused where the capture traces the BatchNorm; whole under --leaf, as
    that refusal says, it counts its own batches and compiles."""
    model = tmp_path / "bn.py"
    model.write_text(MODEL.replace("NORM", "lambda: nn.BatchNorm1d(16, momentum=None)"))
    plan = autopart.compile(model, pp=2, microbatches=2, global_batch_size=4, leaf="BatchNorm1d", measure=False)
    assert len(plan.stages) == 2
