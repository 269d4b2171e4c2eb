"""A file the user names that is there but cannot be read ends the command as every other bad
input does: one line naming the file, exit code 2, no traceback (an OSError's traceback before).

The unreadable file is a link to ``/proc/self/mem``, whose first page no process may read (an
I/O error): a file without read permission would be read all the same by root, as tests may run."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import environment

MODEL = """
import torch
def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)
def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
def build_model():
    return torch.nn.Linear(8, 4)
"""

pytestmark = pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc/self/mem")


def refused(folder: Path, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "autopart.tools.cli", *args], capture_output=True, text=True,
                            timeout=300, env=environment(), cwd=folder)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("autopart: error: ")
    assert not (folder / "out").exists()
    return lines[0]


@pytest.mark.parametrize(("flag", "name", "said"), [
    ("--plan", "plan.json", "plan file 'plan.json' cannot be read (Input/output error)"),
    ("--costs", "costs.json", "cost database 'costs.json' cannot be read (Input/output error)"),
    ("model", "unread.py", "model file 'unread.py' cannot be read (Input/output error)"),
])
def test_an_unreadable_file_is_refused_in_one_line(tmp_path, flag, name, said):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / name).symlink_to("/proc/self/mem")
    model, extra = (name, []) if flag == "model" else ("model.py", [flag, name])
    assert said in refused(tmp_path, "compile", model, "-o", "out", *extra)


def test_a_folder_given_as_the_plan_is_refused_in_one_line(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "plans").mkdir()
    line = refused(tmp_path, "compile", "model.py", "-o", "out", "--plan", "plans")
    assert "plan file 'plans' cannot be read (Is a directory)" in line


def test_a_run_whose_original_model_file_cannot_be_read_takes_the_copy_in_its_output(tmp_path):
    """The ranks take the data functions from the model file that was compiled, or from the copy
    in OUT where it changed since: one that cannot be read any more ended the rank in a traceback."""
    import autopart
    from autopart.runtime.data import model_file

    model = tmp_path / "model.py"
    model.write_text(MODEL)
    plan = autopart.compile(model, pp=1, device="a100-80gb")
    assert model_file(tmp_path / "out", plan) == model
    model.unlink()
    model.symlink_to("/proc/self/mem")
    assert model_file(tmp_path / "out", plan) == tmp_path / "out" / "model.py"
