"""A forward that updates a buffer of its own in place (a step counter) trains with that update:
torch.fx cannot record it (the op reaches no traced tensor, so it runs once while tracing), and
torch.export records it as an op whose value nothing reads."""

import pytest

import autopart
from autopart.ir.errors import CaptureError

MODEL = """
import torch
from torch import nn


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.relu(self.fc(x))


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(Counted(), Counted(), nn.Linear(8, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
"""


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "counted.py"
    path.write_text(MODEL)
    return path


def test_the_stages_run_the_buffer_updates(tmp_path, model):
    """Each update runs on the stage that holds its buffer: none was on any stage before, the
    counter left as built, in the programs and in every checkpoint, while verify saw nothing."""
    out = tmp_path / "out"
    plan = autopart.compile(model, pp=2, microbatches=2, global_batch_size=4, measure=False)
    assert plan.provenance.capture == "export"  # fx could not record the updates
    autopart.emit(plan, out)
    sources = "".join(p.read_text() for p in sorted((out / "stages").glob("stage_*.py")))
    assert "add_.Tensor(getattr(self, '0').calls, 1)" in sources and "add_.Tensor(getattr(self, '1').calls, 1)" in sources


def test_fx_refuses_an_update_it_cannot_record(model):
    with pytest.raises(CaptureError, match=r"changes its buffer '0.calls' \(and 1 more\) by an op that the capture"):
        autopart.compile(model, pp=2, microbatches=2, global_batch_size=4, capture="fx", measure=False)
