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


def test_compile_explain_and_train_py_tell_the_commands_of_uneven_nodes(tmp_path, capsys):
    """3 ranks on nodes of 2: a node of 2 and a node of 1, each told its own command (a one-node
    ``--nproc-per-node 3`` would not fit a node of 2 devices), alike wherever they are printed."""
    out = tmp_path / "out"
    cli.main(["compile", str(MODEL), "-o", str(out), "--pp", "3", "--microbatches", "3", "--global-batch-size", "6", "--gpus-per-node", "2",
              "--no-measure"])
    printed = capsys.readouterr().out
    static = f"--master-addr HOST --master-port 29500 {out}/train.py"
    node_0 = f"torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 {static}"
    node_1 = f"torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 {static}"
    assert (f"train with, on 2 nodes (HOST: the first node's address):\n  on node 0: {node_0} --steps 10\n"
            f"  on node 1: {node_1} --steps 10") in printed, printed
    cli.main(["explain", str(out)])
    measure = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("measure a step with: "))
    trace = "--steps 3 --trace trace.json"
    assert measure == (f"measure a step with: on node 0: {node_0} {trace}; on node 1: {node_1} {trace} (HOST: the "
                       "first node's address)"), measure
    docstring = (out / "train.py").read_text()
    assert f"    on node 0: {node_0} --steps 10\n    on node 1: {node_1} --steps 10\n" in docstring, docstring
