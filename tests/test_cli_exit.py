"""The ``autopart`` command ends, where its work ends well, short of the interpreter's teardown
(`autopart.tools.cli.run`): after the exit handlers and with its streams flushed, its files
whole, the cycle collector off to the end; an error still ends in its one line and exit code 2."""

import subprocess
import sys

from tests.distributed import REPO, environment

SCRIPT = """
import atexit, gc, sys

class Torn:
    def __del__(self, open=open):  # builtins may be gone by then
        open({torn!r}, "w").write("torn down")

kept = Torn()  # freed only by the interpreter's teardown
atexit.register(lambda: open({handled!r}, "w").write("handled"))
atexit.register(lambda: open({collector!r}, "w").write("on" if gc.isenabled() else "off"))
print("unflushed", end="")
sys.argv = ["autopart", *{argv!r}]
from autopart.tools.cli import run
run()
"""


def _run(tmp_path, *argv):
    script = SCRIPT.format(torn=str(tmp_path / "torn"), handled=str(tmp_path / "handled"),
                           collector=str(tmp_path / "collector"), argv=list(argv))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=environment(), cwd=REPO)


def test_a_command_that_ends_well_skips_the_teardown_after_its_exit_handlers(tmp_path):
    out = tmp_path / "out"
    done = _run(tmp_path, "compile", str(REPO / "examples" / "gpt.py"), "-o", str(out), "--pp", "1", "--device",
                "h100-sxm")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("unflushed")  # the streams flushed
    assert (tmp_path / "handled").read_text() == "handled"  # the exit handlers ran
    assert not (tmp_path / "torn").exists()  # the interpreter's teardown did not
    assert (tmp_path / "collector").read_text() == "off"  # nor did the cycle collector, after the compile
    assert (out / "plan.json").read_text().rstrip().endswith("}") and (out / "train.py").is_file()


def test_an_error_still_ends_in_its_line_and_code_2(tmp_path):
    done = _run(tmp_path, "compile", str(tmp_path / "missing.py"), "-o", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.startswith("autopart: error:") and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert (tmp_path / "handled").read_text() == "handled"
    assert (tmp_path / "torn").read_text() == "torn down"  # an ordinary exit, teardown and all


def test_a_reader_gone_ends_in_code_120_without_a_traceback(tmp_path):
    # ``autopart explain ... | head``: the flush at the end finds the pipe closed, as Python's own exit would
    # the writer waits for its go on stdin, so that the reader has left whatever else runs here
    script = ("import sys; from autopart.runtime.process_exit import leave; sys.stdin.readline(); "
              "sys.stdout.write('x' * 100); leave()")
    buffered = {name: value for name, value in environment().items() if name != "PYTHONUNBUFFERED"}
    process = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=buffered, cwd=REPO)
    process.stdout.close()  # the reader leaves before the writer flushes
    process.stdin.write(b"go\n")
    process.stdin.close()
    assert process.wait(timeout=60) == 120
    assert process.stderr.read() == b""
    process.stderr.close()
