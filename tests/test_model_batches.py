"""A model file's own ``batches`` drawn from the global random generators: every rank draws the
same batches whatever its training did with those generators between two draws (each forward
seeds torch's per stage), and training's own random state is left as it was."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.model_file import load_model_file
from autopart.runtime.data import eval_batches, global_batches

MODEL = """\
import random
import torch

def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4))

def example_batch(b):
    return (torch.zeros(b, 8),), torch.zeros(b, 4)

def loss_fn(out, target):
    return ((out - target) ** 2).mean()

def batches(b, seed):  # the global generators, never seeded here: one draw when called, the rest as it goes
    shift = torch.randn(())
    return _drawn(b, shift)

def _drawn(b, shift):
    while True:
        scale = random.choice([0.5, 1.0, 2.0])
        yield (scale * torch.randn(b, 8) + shift,), torch.randn(b, 4)

def eval_batches(b, seed):  # a list: any iterable will do
    return [((torch.randn(b, 8),), torch.randn(b, 4)) for _ in range(3)]
"""


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return path


def _drawn(model: Path, reseed: int) -> list[torch.Tensor]:
    """Three batches, the global generators seeded by ``reseed`` (as a stage's forward does)
    between two draws; each draw leaves them as it found them."""
    data = global_batches(load_model_file(model, build=False), 4, 7)
    drawn = []
    for step in range(3):
        torch.manual_seed(reseed + step)
        random.seed(reseed + step)
        training = torch.get_rng_state(), random.getstate()
        inputs, target = next(data)
        assert torch.equal(torch.get_rng_state(), training[0]) and random.getstate() == training[1]
        drawn += [inputs[0], target]
    return drawn


def test_batches_from_the_global_generators_are_the_same_on_every_rank(model: Path) -> None:
    stage_0, stage_1 = _drawn(model, 100), _drawn(model, 200)
    assert all(torch.equal(a, b) for a, b in zip(stage_0, stage_1))
    assert not torch.equal(stage_0[0], stage_0[2]), "each step a new batch"
    spec = load_model_file(model, build=False)
    torch.manual_seed(1)
    first = eval_batches(spec, 4, 7, 2)
    torch.manual_seed(2)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, eval_batches(spec, 4, 7, 2)))


@pytest.mark.multiprocess
def test_a_pipeline_trains_on_such_batches_as_one_process(model: Path, tmp_path: Path) -> None:
    from autopart.tools.verify import verify

    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, pp=2, microbatches=2, micro_batch_size=2, measure=False), out)
    result = verify(out, steps=3)
    assert result.matches, result.failures


PADDED_LABELS = """\
import torch

def build_model():
    return torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))

def example_batch(b):
    tokens = torch.randint(1, 64, (b, 9), generator=torch.Generator().manual_seed(1))
    labels = tokens[:, 1:].clone()
    labels[:, -3:] = -100  # padding, which cross_entropy leaves out
    return (tokens[:, :-1],), labels

def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1), ignore_index=-100)
"""


def test_synthetic_labels_keep_clear_of_a_marker_like_ignore_index(tmp_path: Path) -> None:
    """Drawn over the example's whole range, labels from -100 to 63 held values such as -43,
    which cross_entropy refuses; the markers are left out of the range, the classes kept."""
    path = tmp_path / "padded.py"
    path.write_text(PADDED_LABELS)
    spec = load_model_file(path)
    for inputs, labels in [next(global_batches(spec, 16, seed)) for seed in range(3)]:
        assert int(labels.min()) >= 0 and int(labels.max()) <= 63 and int(inputs[0].min()) >= 1
        assert torch.isfinite(spec.loss_fn(spec.module(*inputs), labels))


def test_signed_integers_keep_their_range(tmp_path: Path) -> None:
    """Several negative values are a signed range (relative positions), not a marker."""
    path = tmp_path / "signed.py"
    path.write_text(PADDED_LABELS.replace("labels[:, -3:] = -100", "labels[:, -3:] = torch.tensor([-1, -2, -3])"))
    drawn = torch.cat([next(global_batches(load_model_file(path), 16, seed))[1].flatten() for seed in range(3)])
    assert int(drawn.min()) < 0


def test_synthetic_labels_take_their_range_from_an_example_drawn_in_a_state_of_its_own(tmp_path: Path) -> None:
    """An ``example_batch`` that draws its labels from the global generator over few samples sees
    another range at every call: the synthetic batches take it from one drawn apart, the same on
    every rank and launch, whatever the global generator holds (else a loss-only last stage drew
    other labels than one process did, and verify failed a model it had compiled right)."""
    model = tmp_path / "labels.py"
    model.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Linear(4, 8)\n"
        "def example_batch(b):\n    return (torch.randn(b, 4),), torch.randint(0, 8, (b,))\n"
    )  # fmt: skip
    spec = load_model_file(model, build=False)
    drawn = []
    for seed in range(6):
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        batches = global_batches(spec, 2, 0)
        drawn.append(torch.cat([next(batches)[1] for _ in range(8)]))
        assert torch.equal(torch.get_rng_state(), state), "training's generator left as it was"
    assert all(torch.equal(labels, drawn[0]) for labels in drawn)
