"""Bad input ends as one line naming the problem, exit code 2, no traceback, no output directory."""

import textwrap

import pytest

from tests.distributed import run_cli

GOOD_BATCH = """
import torch
def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)
def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
"""

CASES = {
    "missing": (None, r"model file '.*missing\.py' does not exist"),
    "no_build_model": (GOOD_BATCH, r"does not define build_model\(\); add `def build_model\(\) -> nn.Module`"),
    "raises_on_import": (
        "import torch\nraise ValueError('bad config')\n",
        r"importing raises_on_import\.py failed: ValueError: bad config \(raises_on_import\.py:2\)",
    ),
    "raises_in_build_model": (
        GOOD_BATCH + "\ndef build_model():\n    return torch.nn.Linear(8, -4)\n",
        r"build_model\(\) in raises_in_build_model\.py raised RuntimeError: .*negative dimension.*\(raises_in_build_model\.py:9\)",
    ),
    "data_dependent": (
        GOOD_BATCH
        + textwrap.dedent(
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
        ),
        r"torch\.fx could not trace data_dependent\.py at data_dependent\.py:14: data-dependent control flow",
    ),
    "returns_not_a_module": (GOOD_BATCH + "\ndef build_model():\n    return 3\n", r"returned int, not a torch\.nn\.Module"),
    "bad_example_batch": (
        "import torch\ndef build_model():\n    return torch.nn.Linear(8, 4)\ndef example_batch(b):\n    return torch.randn(b, 8)\n",
        r"example_batch\(\) in bad_example_batch\.py returned Tensor; it must return \(inputs: tuple, target\)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_model_file_is_one_line_exit_2_and_no_output(tmp_path, case):
    source, pattern = CASES[case]
    model = tmp_path / f"{case}.py"
    if source is not None:
        model.write_text(source)
    out = tmp_path / "out"
    result = run_cli("compile", str(model), "-o", str(out), "--pp", "2")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("autopart: error: ")
    assert __import__("re").search(pattern, lines[0]), lines[0]
    assert not out.exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir()), "a partial output directory was left"


def test_output_directory_with_other_files_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = run_cli("compile", "examples/gpt.py", "-o", str(out), "--pp", "2")
    assert result.returncode == 2
    assert "holds other files" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_bad_flag_is_one_line(tmp_path):
    result = run_cli("compile", "examples/gpt.py", "-o", str(tmp_path / "o"), "--pp", "two")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
