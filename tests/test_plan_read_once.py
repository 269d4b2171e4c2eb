"""The plan of ``--plan`` is read from its file once per compile: the options, their copies, the
check of its model and its rebuild each asked for it, and each read the file again."""

import pytest

import autopart
import autopart.ir.plan
from autopart.tools import cli
from tests.distributed import REPO

MODEL = REPO / "tests" / "models" / "one_linear.py"


@pytest.fixture
def reads(tmp_path, monkeypatch):
    """(the model file, a plan.json compiled from it, the list of the plan files read since)."""
    model = tmp_path / "model.py"
    model.write_text(MODEL.read_text())
    cli.main(["compile", str(model), "-o", str(tmp_path / "first"), "--pp", "1", "--device", "a100-80gb"])
    read = []
    reader = autopart.ir.plan.read_user_file

    def counted(path, *args):
        read.append(path)
        return reader(path, *args)

    monkeypatch.setattr(autopart.ir.plan, "read_user_file", counted)
    return model, tmp_path / "first" / "plan.json", read


def test_the_command_line_reads_the_plan_once(tmp_path, reads):
    model, plan, read = reads
    cli.main(["compile", str(model), "-o", str(tmp_path / "again"), "--plan", str(plan), "--device", "a100-80gb"])
    assert read == [plan], len(read)
    assert (tmp_path / "again" / "plan.json").is_file()


def test_the_api_reads_the_plan_once(reads):
    model, plan, read = reads
    assert autopart.compile(model, plan=plan, device="a100-80gb").mesh["pp"] == 1
    assert read == [plan], len(read)
    autopart.compile(model, plan=plan, device="a100-80gb")  # another compile reads it afresh
    assert read == [plan, plan]
