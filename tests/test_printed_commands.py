"""The commands that compile and explain print to run next are the output folder's as given, to
paste into a shell: a folder named with brackets was read as rich markup ('-o runs/[exp]' printed
'runs//train.py'), and one with a space was split in two words."""

import shlex

import pytest

from autopart.runtime import train
from autopart.tools import cli
from tests.distributed import REPO

MODEL = REPO / "tests" / "models" / "three_layers.py"


def test_compile_explain_and_train_print_the_folder_given(tmp_path, capsys, monkeypatch):
    out = tmp_path / "runs [exp] [bold]1"
    cli.main(["compile", str(MODEL), "-o", str(out), "--pp", "2", "--microbatches", "2", "--no-measure"])
    printed = capsys.readouterr().out
    assert f"wrote {out}/" in printed, printed
    command = next(line for line in printed.splitlines() if line.strip().startswith("torchrun "))
    assert shlex.split(command)[3] == f"{out}/train.py", command
    cli.main(["explain", str(out)])
    printed = capsys.readouterr().out
    measure = next(line for line in printed.splitlines() if line.startswith("measure a step with: "))
    assert shlex.split(measure.removeprefix("measure a step with: "))[3] == f"{out}/train.py", measure
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # started without torchrun: told the command to start it with
    with pytest.raises(SystemExit):
        train.main(out, [])
    line = capsys.readouterr().err.strip()
    assert shlex.split(line.partition("; run ")[2])[3] == f"{out}/train.py", line
