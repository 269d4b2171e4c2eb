"""A model file's own ``batches`` drawn from the global random generators: every rank draws the
same batches whatever its training did with those generators between two draws (each forward
seeds torch's per stage), and training's own random state is left as it was."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch

from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.errors import ModelFileError
from autopart.ir.model_file import load_model_file
from autopart.runtime.data import eval_batches, global_batches, training_batches
from tests.distributed import run_ranks, torchrun

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


BROKEN_BATCHES = {  # name -> (the model file's batches and eval_batches, the error's type name, pattern of its line)
    "runs_out": ("def batches(b, seed):\n    yield (torch.zeros(b, 8),), torch.zeros(b, 4)\n", "ConfigError",
                 r"batches\(4, 7\) of broken\.py ran out after 1 global batches, before the last step .*; make it yield "
                 r"as many as --steps"),
    "not_iterable": ("def batches(b, seed):\n    return 3\n", "ModelFileError",
                     r"batches\(4, 7\) in broken\.py raised TypeError: 'int' object is not iterable; fix batches\(\)"),
    "wrong_signature": ("def batches(b):\n    return []\n", "ModelFileError",
                        r"batches\(4, 7\) in broken\.py raised TypeError: batches\(\) takes 1 positional argument"),
    "raises_while_drawing": ("def batches(b, seed):\n    yield (torch.zeros(b, 8),), torch.zeros(b, 4)\n"
                             "    open('/nonexistent/shard-1')\n", "ModelFileError",
                             r"batches\(4, 7\) in broken\.py raised FileNotFoundError: .*shard-1' \(broken\.py:\d+\)"),
}


def test_the_batches_of_a_loop_of_one_s_own_end_with_the_model_file_s():
    """`global_batches` (``pipeline.batches()``) ends where the data does: a loop of the user's own
    may run an epoch; only a run of a given number of steps (`training_batches`) is refused."""
    spec = load_model_file(Path(__file__).parent / "models" / "tiny_gpt.py", build=False)
    spec = dataclasses.replace(spec, batches=lambda b, seed: [spec.example_batch(b)] * 2)
    assert len(list(global_batches(spec, 4, 0))) == 2


@pytest.mark.parametrize("case", sorted(BROKEN_BATCHES))
def test_a_model_file_s_broken_batches_are_one_line(tmp_path: Path, case: str) -> None:
    """The user's data code fails inside training, on every rank alike: a named error (one line,
    exit 2), not a traceback per rank; running out before --steps too, where it was a StopIteration."""
    source, kind, pattern = BROKEN_BATCHES[case]
    model = tmp_path / "broken.py"
    model.write_text(MODEL.split("def batches")[0] + source)
    data = training_batches(load_model_file(model, build=False), 4, 7)
    with pytest.raises(Exception) as raised:
        for _ in range(3):
            next(data)
    assert type(raised.value).__name__ == kind and re.search(pattern, str(raised.value)), repr(raised.value)


def test_broken_eval_batches_are_one_line(tmp_path: Path) -> None:
    model = tmp_path / "broken.py"
    model.write_text(MODEL.replace("    return [((torch.randn(b, 8),)", "    raise KeyError('split')\n    return [((torch.randn(b, 8),)"))
    with pytest.raises(ModelFileError, match=r"eval_batches\(4, 7\) in broken\.py raised KeyError: 'split' \(broken\.py:\d+\)"):
        eval_batches(load_model_file(model, build=False), 4, 7, 2)


def _compiled_with_one_batch(folder: Path) -> Path:
    """OUT of a model file, ``folder/short.py``, whose batches() yields one batch: two stages."""
    model = folder / "short.py"
    model.write_text(MODEL.split("def batches")[0] + BROKEN_BATCHES["runs_out"][0])
    out = folder / "out"
    compile_to_directory(CompileOptions(model=model, pp=2, microbatches=2, micro_batch_size=2, measure=False), out)
    return out


@pytest.mark.multiprocess
def test_batches_that_run_out_end_each_rank_in_its_line_and_code_2(tmp_path: Path) -> None:
    out = _compiled_with_one_batch(tmp_path)
    with pytest.raises(AssertionError) as failed:
        torchrun(out, 2, "--steps", "3")
    text = str(failed.value)
    assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text and "StopIteration" not in text, text
    assert text.count("autopart: error: batches(4, 0) of short.py ran out after 1 global batches") == 2, text
    assert "exitcode: 2" in text or "(exitcode: 2)" in text, text


@pytest.mark.parametrize("edit, message", [
    (("scale * torch.randn(b, 8)", "scale * torch.randn(b, 9)"),
     r"batches\(\) in model\.py: input 0 has shape \(4, 9\), where example_batch's is \(4, 8\), the shape the plan was "
     r"compiled for; give batches of example_batch's shapes"),
    (("torch.randn(b, 4)", "torch.randn(b, 2, 4)"), r"batches\(\) in model\.py: the target has shape \(4, 2, 4\)"),
    (("yield (scale * torch.randn(b, 8) + shift,)", "yield (scale * torch.randn(b, 8) + shift, torch.zeros(b))"),
     r"batches\(\) in model\.py gives 2 inputs, where example_batch gives 1"),
    (("[((torch.randn(b, 8),)", "[((torch.randn(b, 16),)"), r"eval_batches\(\) in model\.py: input 0 has shape \(4, 16\)"),
    (("torch.randn(b, 4)\n", "torch.randn(b, 4).long()\n"),
     r"batches\(\) in model\.py: the target is int64, where example_batch's is float32, the dtype the plan was compiled "
     r"for; give batches of example_batch's dtypes \(\.to\(torch\.float32\)\)"),
])  # fmt: skip
def test_batches_of_other_shapes_than_the_example_are_refused(tmp_path: Path, edit, message) -> None:
    """The plan is compiled for example_batch's shapes: a stage given a batch of 16 tokens where
    the example has 32 failed on its message to the next stage, put down to autocast."""
    from autopart.ir.errors import ModelFileError

    assert edit[0] in MODEL
    path = tmp_path / "model.py"
    path.write_text(MODEL.replace(*edit))
    spec = load_model_file(path, build=False)
    with pytest.raises(ModelFileError, match=message):
        next(global_batches(spec, 4, 7))
        eval_batches(spec, 4, 7, 2)


@pytest.mark.multiprocess
def test_train_py_refuses_batches_of_another_dtype_than_the_example_in_one_line(tmp_path: Path) -> None:
    """Inputs of float64 where the plan was compiled for example_batch's float32: a stage's
    RuntimeError in the first action, with the schedule's grid, exit code 1, not naming batches()."""
    model = tmp_path / "model.py"
    model.write_text(MODEL.replace("yield (scale * torch.randn(b, 8) + shift,)",
                                   "yield ((scale * torch.randn(b, 8) + shift).double(),)"))
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=model, pp=1, microbatches=1, micro_batch_size=2, measure=False), out)
    done = run_ranks(out, 1, "--steps", "2", check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert re.search(r"autopart: error: batches\(\) in model\.py: input 0 is float64, where example_batch's is float32",
                     done.stderr), done.stderr


def test_a_timing_run_draws_a_small_dataset_again_and_a_run_of_steps_does_not(tmp_path: Path) -> None:
    """A model file of three batches failed every run the compile makes of a plan here (its
    pipeline, its finalists: as many steps as fit their seconds) with 'ran out after 3 global
    batches ... lower --steps', a flag the compile's user never gave."""
    model = tmp_path / "three.py"
    model.write_text(MODEL.split("def batches")[0] + "def batches(b, seed):\n"
                     "    return [((torch.full((b, 8), float(i)),), torch.zeros(b, 4)) for i in range(3)]\n")
    spec = load_model_file(model, build=False)
    drawn = [inputs[0][0, 0].item() for (inputs, _), _ in zip(training_batches(spec, 2, 0, epochs=True), range(7))]
    assert drawn == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0]
    with pytest.raises(Exception, match=r"ran out after 3 global batches"):
        list(zip(training_batches(spec, 2, 0), range(4)))
    model.write_text(MODEL.split("def batches")[0] + "def batches(b, seed):\n    return []\n")
    with pytest.raises(Exception, match=r"ran out after 0 global batches"):  # no epoch without end
        next(training_batches(load_model_file(model, build=False), 2, 0, epochs=True))


@pytest.mark.multiprocess
def test_train_py_timing_its_steps_runs_past_the_end_of_the_data(tmp_path: Path) -> None:
    run_ranks(_compiled_with_one_batch(tmp_path), 2, "--steps", "3", "--min-steps", "3", "--seconds", "600")
