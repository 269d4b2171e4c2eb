"""A catalogue of bad inputs. Each one ends as one line naming the problem and what to do, exit
code 2, no traceback, and nothing half-written: no output directory, no partial one beside it,
and an existing directory left as it was.

Most cases call the command line in this process (``autopart.cli.main``); a few run it as a real
subprocess, to show that no traceback reaches the terminal.
"""

import re
import textwrap
from pathlib import Path

import pytest

from autopart import cli
from autopart.runtime import train
from tests.distributed import REPO, run_cli

GOOD_BATCH = """
import torch
def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)
def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
"""
LINEAR = GOOD_BATCH + "\ndef build_model():\n    return torch.nn.Linear(8, 4)\n"
DATA_DEPENDENT = GOOD_BATCH + textwrap.dedent(
    """
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.linear(x)
            return -self.linear(x)

    def build_model():
        return Gate()
    """
)
NO_INITIALISER = GOOD_BATCH + textwrap.dedent(
    """
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4))

        def forward(self, x):
            return x * self.weight

    def build_model():
        with torch.device("meta"):
            return torch.nn.Sequential(torch.nn.Linear(8, 4), Scale())
    """
)

# name -> (model source or None for a missing file, extra arguments, pattern of the one line)
MODEL_CASES = {
    "missing": (None, [], r"model file '.*missing\.py' does not exist"),
    "no_build_model": (GOOD_BATCH, [], r"does not define build_model\(\); add `def build_model\(\) -> nn.Module`"),
    "raises_on_import": (
        "import torch\nraise ValueError('bad config')\n",
        [],
        r"importing raises_on_import\.py failed: ValueError: bad config \(raises_on_import\.py:2\)",
    ),
    "raises_in_build_model": (
        GOOD_BATCH + "\ndef build_model():\n    return torch.nn.Linear(8, -4)\n",
        [],
        r"build_model\(\) in raises_in_build_model\.py raised RuntimeError: .*negative dimension.*\(raises_in_build_model\.py:9\)",
    ),
    "returns_not_a_module": (GOOD_BATCH + "\ndef build_model():\n    return 3\n", [], r"returned int, not a torch\.nn\.Module"),
    "contract_not_a_function": (
        LINEAR.replace("def example_batch(batch_size):", "example_batch = 3\ndef _unused(batch_size):"),
        [],
        r"example_batch in contract_not_a_function\.py is a int, not a function; define it with def",
    ),
    "bad_example_batch": (
        "import torch\ndef build_model():\n    return torch.nn.Linear(8, 4)\ndef example_batch(b):\n    return torch.randn(b, 8)\n",
        [],
        r"example_batch\(\) in bad_example_batch\.py returned Tensor; it must return \(inputs: tuple, target\)",
    ),
    "batch_not_first": (
        LINEAR.replace("torch.randn(batch_size, 8)", "torch.randn(8, batch_size)"),
        [],
        r"example_batch\(2\) in batch_not_first\.py: input 0 has shape \(8, 2\), whose first dimension is not the batch size 2",
    ),
    "model_rejects_batch": (
        LINEAR.replace("torch.randn(batch_size, 8)", "torch.randn(batch_size, 5)"),
        [],
        r"the model rejects its own example batch: RuntimeError: .*; make example_batch\(\) match the model's forward",
    ),
    "loss_not_scalar": (
        LINEAR.replace("mse_loss(output, target)", "mse_loss(output, target, reduction='none')"),
        [],
        r"the loss of loss_not_scalar\.py is not a scalar tensor; define loss_fn",
    ),
    "neither_fx_nor_export": (
        DATA_DEPENDENT,
        [],
        r"neither torch\.fx \(Python control flow on a traced shape or tensor at neither_fx_nor_export\.py:14\) nor "
        r"torch\.export could capture neither_fx_nor_export\.py: control flow on tensor values at neither_fx_nor_export\.py:14",
    ),
    "fx_forced_on_untraceable": (
        DATA_DEPENDENT,
        ["--capture", "fx"],
        r"torch\.fx could not trace fx_forced_on_untraceable\.py: .* at fx_forced_on_untraceable\.py:14; .*--capture export",
    ),
    "unknown_leaf_class": (LINEAR, ["--leaf", "Mixer"], r"--leaf Mixer: the model has no module of that class; its classes include Linear"),
    "meta_without_initialiser": (
        NO_INITIALISER,
        [],
        r"builds the model on the meta device, but module '1' \(Scale\) has no reset_parameters\(\) and "
        r"meta_without_initialiser\.py defines no init_weights\(module\)",
    ),
    "not_a_python_file": (LINEAR, [], r"is not a \.py file"),
}

OPTION_CASES = {
    "batch_does_not_divide": (["--global-batch-size", "10", "--microbatches", "4"], r"the global batch \(10\) is not a whole number of microbatches"),
    "interleaved_does_not_divide": (
        ["--schedule", "interleaved", "--chunks", "2", "--microbatches", "3", "--global-batch-size", "6"],
        r"interleaved needs microbatches \(3\) to be a multiple of the pipeline degree \(2\); use --microbatches 4",
    ),
    "more_stages_than_blocks": (["--pp", "64"], r"places where a pipeline stage can start but 64 stages were asked for; use --pp \d+ or fewer"),
    "unknown_device": (["--device", "tpu-v9"], r"unknown device 'tpu-v9'; known devices: .*h100-sxm"),
    "unknown_schedule": (["--schedule", "zigzag"], r"unknown schedule 'zigzag'; use one of gpipe"),
    "out_of_memory": (
        ["--memory", "0.0001"],
        r"the model does not fit: .* the fullest device needs 0\.\d+ GiB but the memory limit is 0\.00 GiB; raise --memory",
    ),
    "bad_flag_value": (["--pp", "two"], r"argument --pp: invalid int value: 'two'"),
    "profile_pipeline_without_costs": (
        ["--profile-pipeline"], r"--profile-pipeline keeps what it measures in a cost database: add --costs COSTS.json"
    ),
    "profile_pipeline_of_another_device": (
        ["--profile-pipeline", "--costs", "costs.json", "--device", "h100-sxm"],
        r"--profile-pipeline runs the plan on this machine's CPU, so it profiles plans for --device cpu, not h100-sxm",
    ),
}


def call_cli(capsys, *argv: str) -> str:
    """Run the command line in this process; return its one stderr line, having checked the contract."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("autopart: error: ")
    return lines[0]


def assert_nothing_written(folder: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in folder.iterdir() if p.name.startswith(f".{out.name}")], "a partial output was left"


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_bad_model_file(tmp_path, capsys, case):
    source, extra, pattern = MODEL_CASES[case]
    model = tmp_path / (f"{case}.txt" if case == "not_a_python_file" else f"{case}.py")
    if source is not None:
        model.write_text(source)
    out = tmp_path / "out"
    line = call_cli(capsys, "compile", str(model), "-o", str(out), "--pp", "2", *extra)
    assert re.search(pattern, line), line
    assert_nothing_written(tmp_path, out)


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_bad_options(tmp_path, capsys, case):
    extra, pattern = OPTION_CASES[case]
    model = tmp_path / "linear.py"
    model.write_text(LINEAR)
    out = tmp_path / "out"
    line = call_cli(capsys, "compile", str(model), "-o", str(out), "--pp", "2", *extra)
    assert re.search(pattern, line), line
    assert_nothing_written(tmp_path, out)


def test_malformed_device_spec(tmp_path, capsys):
    spec = tmp_path / "mygpu.toml"
    spec.write_text("name = 'mygpu'\npeak_flops = [oops\n")
    line = call_cli(capsys, "compile", "examples/gpt.py", "-o", str(tmp_path / "out"), "--device", str(spec))
    assert re.search(r"mygpu\.toml: not valid TOML .*; fix the file", line), line
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_output_directory_with_other_files_is_left_alone(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    line = call_cli(capsys, "compile", "examples/gpt.py", "-o", str(out), "--pp", "2")
    assert "output directory" in line and "holds other files; choose a new or empty directory" in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_output_path_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("mine")
    line = call_cli(capsys, "compile", "examples/gpt.py", "-o", str(out))
    assert "is a file; choose a directory path for -o" in line
    assert out.read_text() == "mine"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """One small compiled output directory, shared by the plan and weights cases."""
    out = tmp_path_factory.mktemp("compiled") / "out"
    cli.main(["compile", str(REPO / "examples" / "gpt.py"), "-o", str(out), "--pp", "2", "--microbatches", "2"])
    return out


@pytest.mark.parametrize(
    "name, text, pattern",
    [
        ("not_json", "{ not json", r"bad\.json is not valid JSON .*; fix it or recompile"),
        ("missing_field", '{"version": 1}', r"plan\.mesh is missing; the plan is incomplete"),
        ("wrong_version", '{"version": 99}', r"plan version 99 is not supported"),
    ],
)
def test_malformed_plan(tmp_path, capsys, name, text, pattern):
    plan = tmp_path / "bad.json"
    plan.write_text(text)
    line = call_cli(capsys, "compile", "examples/gpt.py", "-o", str(tmp_path / "out"), "--plan", str(plan))
    assert re.search(pattern, line), line
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_plan_of_another_model(tmp_path, capsys, compiled):
    line = call_cli(capsys, "compile", "examples/llama.py", "-o", str(tmp_path / "out"), "--plan", str(compiled / "plan.json"))
    assert re.search(r"plan\.json was compiled from another version of llama\.py .*; recompile without --plan", line), line
    assert_nothing_written(tmp_path, tmp_path / "out")


def run_train(capsys, monkeypatch, out: Path, *argv: str) -> str:
    """train.py as rank 0 of the plan's world, in this process: the checks that precede any peer."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        train.main(out, list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_weights_file_that_lacks_parameters(tmp_path, capsys, monkeypatch, compiled):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(compiled / "weights" / "stage_0.safetensors"))
    dropped = sorted(weights)[0]
    save_file({k: v for k, v in weights.items() if k != dropped}, str(tmp_path / "partial.safetensors"))
    line = run_train(capsys, monkeypatch, compiled, "--weights", str(tmp_path / "partial.safetensors"))
    assert f"lacks 1 tensor(s) of stage 0, first '{dropped}'" in line, line
    assert "save every parameter under its name in the original model" in line


def test_weights_file_that_is_not_safetensors(tmp_path, capsys, monkeypatch, compiled):
    (tmp_path / "w.safetensors").write_text("not a checkpoint")
    line = run_train(capsys, monkeypatch, compiled, "--weights", str(tmp_path / "w.safetensors"))
    assert "is not a safetensors file" in line, line


def test_wrong_world_size(capsys, monkeypatch, compiled):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        train.main(compiled, [])
    assert "the plan needs 2 processes but 3 were started" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["compile", "{tmp}/missing.py", "-o", "{tmp}/out"], r"model file '.*missing\.py' does not exist"),
        (["compile", "{tmp}/gate.py", "-o", "{tmp}/out", "--pp", "2"], r"neither torch\.fx .* nor torch\.export could capture gate\.py"),
    ],
)
def test_no_traceback_reaches_the_terminal(tmp_path, argv, pattern):
    (tmp_path / "gate.py").write_text(DATA_DEPENDENT)
    result = run_cli(*(a.format(tmp=tmp_path) for a in argv))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert_nothing_written(tmp_path, tmp_path / "out")
