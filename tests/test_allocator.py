"""The generated train.py turns on the CUDA caching allocator's expandable segments before torch
is imported, and never over the user's own setting."""

import json
import subprocess
import sys

import pytest

from autopart.runtime.allocator import EXPANDABLE, prefer_expandable_segments
from autopart.tools import cli
from tests.distributed import REPO, environment


def test_expandable_segments_are_asked_for_under_the_name_every_torch_reads():
    environ: dict[str, str] = {}
    prefer_expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}


@pytest.mark.parametrize("users", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"])
def test_the_user_s_own_setting_is_kept(users):
    environ = {users: "max_split_size_mb:512"}
    prefer_expandable_segments(environ)
    assert environ == {users: "max_split_size_mb:512"}


PROBE = """
import builtins, json, os, runpy, sys

seen = {{}}
real_import = builtins.__import__

def probe(name, *args, **kwargs):
    if name.split(".")[0] == "torch" and "torch" not in sys.modules and "at_torch" not in seen:
        seen["at_torch"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return real_import(name, *args, **kwargs)

builtins.__import__ = probe
sys.argv = [{train!r}, "--help"]
try:
    runpy.run_path({train!r}, run_name="__main__")
except SystemExit:
    pass
print("PROBE " + json.dumps(seen))
"""


def test_train_py_sets_it_before_torch_is_imported(tmp_path, capsys):
    out = tmp_path / "out"
    cli.main(["compile", str(REPO / "examples" / "gpt.py"), "-o", str(out), "--pp", "2", "--no-measure"])
    capsys.readouterr()
    env = {k: v for k, v in environment().items() if not k.endswith("ALLOC_CONF")}
    result = subprocess.run([sys.executable, "-c", PROBE.format(train=str(out / "train.py"))], capture_output=True,
                            text=True, timeout=120, env=env, cwd=tmp_path)
    line = next(line for line in result.stdout.splitlines() if line.startswith("PROBE "))
    seen = json.loads(line.removeprefix("PROBE "))["at_torch"]
    assert seen == EXPANDABLE, (seen, result.stderr[-2000:])
