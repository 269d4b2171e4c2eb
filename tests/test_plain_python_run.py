"""train.py of a 1-rank plan run as a plain python program, as a user runs it without torchrun:
it trains, and its refusals leave as a finished run does."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from autopart.tools import cli
from tests.distributed import REPO, environment


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    """A compile of a 1-rank plan."""
    out = tmp_path_factory.mktemp("one_rank") / "out"
    cli.main(["compile", str(REPO / "examples" / "gpt.py"), "-o", str(out), "--world-size", "1", "--microbatches", "1",
              "--global-batch-size", "2"])
    return out


def _plain_python(*argv: str, script: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python ARGV`` as a user runs it without torchrun (no RANK, WORLD_SIZE, MASTER_*; ``env``
    adds some), or ``script`` run first and ``ARGV[0]`` after it as ``__main__`` with ARGV[1:] its
    arguments."""
    env = {name: value for name, value in environment().items() if name not in _TORCHRUN_VARIABLES} | (env or {})
    command = [sys.executable, *argv] if not script else [
        sys.executable, "-c", script + f"\nimport runpy, sys\nsys.argv = {list(argv)!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)


def _damaged_save(folder: Path) -> None:
    """A save whose record lists nothing: every rank finds it damaged together, past the launch checks."""
    (folder / "step_00000001").mkdir(parents=True)
    (folder / "step_00000001" / "autopart.json").write_text("{}")


@pytest.mark.multiprocess
def test_a_one_rank_plan_trains_as_a_plain_python_program(tmp_path, one_rank):
    """``python OUT/train.py`` of a 1-rank plan, without torchrun: it trains, saves and resumes as
    under torchrun, where it ended in torch's env:// traceback."""
    metrics, checkpoints = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    for steps, resume in (("2", []), ("3", ["--resume"])):
        done = _plain_python(str(one_rank / "train.py"), "--steps", steps, "--metrics", str(metrics),
                             "--checkpoint-dir", str(checkpoints), *resume)  # fmt: skip
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2]


@pytest.mark.multiprocess
def test_a_refusal_once_the_process_group_is_made_leaves_as_a_finished_run_does(tmp_path, one_rank):
    """Refused after the process group was made (here: --resume where every save is damaged),
    train.py says its line and exits 2 past the interpreter's teardown, as a finished run leaves
    (`autopart.runtime.process_exit.leave`): gloo's teardown can abort there (SIGABRT) after the
    line, rarely and under load, so the test checks the way out, not the abort. Its exit handlers run."""
    _damaged_save(tmp_path / "userX")
    marks = {name: tmp_path / name for name in ("torn", "handled")}
    script = (f"import atexit\nclass Torn:\n    def __del__(self, open=open):\n        open({str(marks['torn'])!r}, 'w')\n"
              f"kept = Torn()  # freed only by the interpreter's teardown\n"
              f"atexit.register(lambda: open({str(marks['handled'])!r}, 'w'))")
    done = _plain_python(str(one_rank / "train.py"), "--steps", "2", "--checkpoint-dir", str(tmp_path / "userX"),
                         "--resume", script=script)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1].startswith("autopart: error: every checkpoint in"), done.stderr
    assert marks["handled"].exists() and not marks["torn"].exists()


@pytest.mark.multiprocess
def test_a_rank_s_warning_is_one_write(tmp_path, one_rank):
    """The ranks of a node share its stderr: a line written as print writes it (the text, then its
    newline) ran into another rank's, ``...(rank 0)autopart: checkpoint ...``."""
    _damaged_save(tmp_path / "userX")
    script = ("import sys\nclass Writes:\n    def __init__(self, stream):\n        self.stream = stream\n"
              "    def write(self, text):\n        return self.stream.write(repr(text) + '\\n')\n"
              "    def __getattr__(self, name):\n        return getattr(self.stream, name)\n"
              "sys.stderr = Writes(sys.stderr)  # each write on a line of its own")
    done = _plain_python(str(one_rank / "train.py"), "--steps", "2", "--checkpoint-dir", str(tmp_path / "userX"),
                         "--resume", script=script)
    writes = [ast.literal_eval(line) for line in done.stderr.splitlines()]
    assert done.returncode == 2 and len(writes) == 2, done.stderr
    assert writes[0].startswith("autopart: checkpoint ") and writes[0].endswith(" (rank 0)\n"), writes
    assert writes[1].startswith("autopart: error: every checkpoint in ") and writes[1].endswith("\n"), writes


_TORCHRUN_VARIABLES = frozenset(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                 "GROUP_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("given", [{"WORLD_SIZE": "1"}, {"RANK": "0"}, {"RANK": "0", "WORLD_SIZE": "1"}])
def test_a_one_rank_plan_runs_as_python_with_part_of_torchrun_s_variables(tmp_path, one_rank, given):
    """A cluster's shell may export WORLD_SIZE=1 (or RANK=0) alone: still a world of this process,
    not torch's env:// traceback for the variable it lacks."""
    done = _plain_python(str(one_rank / "train.py"), "--steps", "1", env=given)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.multiprocess
def test_a_plan_of_a_newer_torch_is_warned_of_once_by_rank_0(one_rank):
    """train.py's rank 0 says that the torch that compiled the plan is newer than its own (here
    made to think so: `autopart.runtime.launch.older_torch` answers as for a plan of torch 99)."""
    script = ("import autopart.runtime.train as train\n"
              "train.older_torch = lambda plan: 'the plan was compiled under torch 99.0'")
    done = _plain_python(str(one_rank / "train.py"), "--steps", "1", script=script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("autopart: warning: the plan was compiled under torch 99.0\n") == 1, done.stderr
