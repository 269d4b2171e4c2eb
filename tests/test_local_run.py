"""`autopart.tools.local_run`: the runs a compile makes here start their ranks from one forked
process on the CPU (torchrun on the GPUs): they train as torchrun's ranks do, fail and time out
with the same errors, and leave nothing running behind them."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from autopart.tools import local_run
from autopart.tools.local_run import LocalRunError, run_locally
from tests.distributed import FREE_LINKS, REPO, environment

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpt") / "out"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=2, micro_batch_size=2,
                                        device=str(FREE_LINKS)), out)  # fmt: skip
    return out


def _losses(out: Path, work: Path, forked: bool, *args: str) -> list[float]:
    metrics = work / f"metrics-{len(list(work.glob('metrics-*')))}.jsonl"  # train.py appends: one file per run
    run_locally(out, 2, ["--steps", "3", "--metrics", str(metrics), *args], timeout_s=120, cwd=work, forked=forked)
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "torchrun"])
def test_a_train_py_edited_in_out_is_never_what_autopart_runs(compiled, tmp_path, forked):
    """verify, a pipeline's profile and the finalists run what the compile wrote: the compile
    checks the stage files, not train.py, and an edited one ran whatever it had become."""
    import shutil

    out = shutil.copytree(compiled, tmp_path / "out")
    ran = tmp_path / "ran"
    (out / "train.py").write_text(f"open({str(ran)!r}, 'w').write('edited')\nraise SystemExit(1)\n")
    assert len(_losses(out, tmp_path, forked)) == 3
    assert not ran.exists()


def test_forked_ranks_train_as_torchrun_s_and_one_process_serves_every_run(compiled, tmp_path):
    by_torchrun = _losses(compiled, tmp_path, False)
    by_fork = _losses(compiled, tmp_path, True)
    assert len(by_fork) == 3 and by_fork == by_torchrun  # the same programs, bit for bit
    zygote = local_run._ZYGOTE.process
    reseeded = _losses(compiled, tmp_path, True, "--seed", "1")
    assert len(reseeded) == 3 and reseeded != by_fork  # the arguments reach the ranks
    assert local_run._ZYGOTE.process is zygote and zygote.poll() is None


@pytest.mark.parametrize("forked", [True, False])
def test_a_failed_rank_is_one_error_naming_it_without_waiting_for_its_peer(compiled, tmp_path, monkeypatch, forked):
    monkeypatch.setenv("AUTOPART_FAIL_AT", "1:1")  # rank 1 exits 17 at step 1; rank 0 would wait 120 s for it
    started = time.monotonic()
    with pytest.raises(LocalRunError) as error:
        _losses(compiled, tmp_path, forked)
    # torchrun exits 1 for its failed workers; forked, a rank's own code: the one that died (17), or
    # its peer's (1: it found the connection gone) where both ended before the launcher looked,
    # never the -9 of a peer the launcher killed
    codes = (17, 1) if forked else (1,)
    assert any(str(error.value).startswith(f"the distributed run failed (exit {code})") for code in codes)
    assert "autopart: AUTOPART_FAIL_AT: rank 1 dies at step 1" in str(error.value)
    # below the 120 s that waiting for the peer takes, with room for a loaded machine's start
    assert time.monotonic() - started < 100


def test_each_run_has_the_environment_of_its_launch(compiled, tmp_path, monkeypatch):
    """The ranks are forked from a process started at the first launch: a variable set then and
    gone since is not theirs."""
    monkeypatch.setenv("AUTOPART_FAIL_AT", "1:1")
    local_run._ZYGOTE.close()  # the next launch starts one with the variable set
    with pytest.raises(LocalRunError):
        _losses(compiled, tmp_path, True)
    zygote = local_run._ZYGOTE.process
    monkeypatch.delenv("AUTOPART_FAIL_AT")
    assert len(_losses(compiled, tmp_path, True)) == 3
    assert local_run._ZYGOTE.process is zygote  # the same process: its ranks took the launch's environment


def test_a_run_past_its_time_is_stopped_and_its_ranks_with_it(compiled, tmp_path):
    _losses(compiled, tmp_path, True)  # the zygote is up
    zygote, seen, stop_watching = local_run._ZYGOTE.process.pid, set(), threading.Event()

    def watch():
        while not stop_watching.is_set():
            seen.update(_ranks_of(zygote))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    try:
        with pytest.raises(LocalRunError, match="the distributed run did not finish within 4 s"):
            run_locally(compiled, 2, ["--steps", "1000000"], timeout_s=4, cwd=tmp_path)
    finally:
        stop_watching.set()
        watcher.join()
    assert time.monotonic() - started < 60
    assert len(seen) == 2 and not any(_alive(pid) for pid in seen)


def test_the_ranks_end_with_the_compile_that_started_them(compiled, tmp_path):
    """The compile killed mid-run (SIGKILL: nothing of it runs after): its zygote and the zygote's
    ranks end too, rather than train on for nobody."""
    metrics = tmp_path / "metrics.jsonl"
    code = (f"from pathlib import Path; from autopart.tools.local_run import run_locally; "
            f"run_locally(Path({str(compiled)!r}), 2, ['--steps', '1000000', '--metrics', {str(metrics)!r}], "
            f"timeout_s=300, cwd=Path({str(tmp_path)!r}))")  # fmt: skip
    compile_ = subprocess.Popen([sys.executable, "-c", code], env=environment())
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and compile_.poll() is None, "the ranks never trained"
            time.sleep(0.1)
        zygotes = _zygotes_of(compile_.pid)
        ranks = _ranks_of(zygotes[0]) if len(zygotes) == 1 else []
        assert len(ranks) == 2
    finally:
        compile_.send_signal(signal.SIGKILL)
        compile_.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in [*zygotes, *ranks]):
        assert time.monotonic() < deadline, "the zygote or its ranks outlived the compile"
        time.sleep(0.1)


def test_an_idle_zygote_ends_with_the_compile_though_a_child_holds_its_pipe(compiled, tmp_path):
    """Between runs the zygote waits on its stdin; a process the compile forked (and that outlives
    it) holds that pipe open, so its end never comes: the zygote watches its parent instead."""
    code = "\n".join([
        "import os, time", "from pathlib import Path", "from autopart.tools.local_run import run_locally",
        f"run_locally(Path({str(compiled)!r}), 2, ['--steps', '1'], timeout_s=120, cwd=Path({str(tmp_path)!r}))",
        "child = os.fork()", "if child == 0:", "    time.sleep(30)", "    os._exit(0)",
        "print(child, flush=True)", "time.sleep(600)",
    ])  # fmt: skip
    compile_ = subprocess.Popen([sys.executable, "-c", code], env=environment(), stdout=subprocess.PIPE, text=True)
    holder = None
    try:
        holder = int(compile_.stdout.readline())  # the run is over: the zygote is idle
        zygotes = _zygotes_of(compile_.pid)
        assert len(zygotes) == 1
        compile_.send_signal(signal.SIGKILL)
        compile_.wait()
        deadline = time.monotonic() + 30
        while _alive(zygotes[0]):
            assert _alive(holder), "the pipe's holder ended first: the test proves nothing"
            assert time.monotonic() < deadline, "the idle zygote outlived the compile"
            time.sleep(0.1)
    finally:
        compile_.kill()
        if holder is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # it ended as it was read
    return found


def _zygotes_of(pid: int) -> list[int]:
    return [child for child in _children(pid) if b"rank_zygote" in _cmdline(child)]


def _ranks_of(zygote: int) -> list[int]:
    return [child for child in _children(zygote) if _alive(child)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_gpu_run_goes_to_torchrun(monkeypatch, tmp_path):
    launched = []
    monkeypatch.setattr(local_run, "_torchrun", lambda argv, ranks, env, **kw: launched.append((ranks, env)))
    monkeypatch.setattr(local_run, "run_forked", lambda *a, **kw: pytest.fail("forked a GPU run"))
    run_locally(tmp_path, 2, ["--steps", "1"], timeout_s=10, cwd=tmp_path, gpus=True)
    [(ranks, env)] = launched
    assert ranks == 2 and env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_module_runs_in_each_rank_as_python_m_runs_it(tmp_path):
    """``run_here(["-m", module, ...])``: each rank runs ``module`` as ``__main__``, its file
    first in ``sys.argv`` and the working folder first on ``sys.path``, as ``python -m`` does."""
    (tmp_path / "probe_rank.py").write_text(
        "import json, os, sys\n"
        "if __name__ == '__main__':\n"
        "    with open(f'rank_{os.environ[\"RANK\"]}.json', 'w') as out:\n"
        "        json.dump({'argv': sys.argv, 'path0': sys.path[0]}, out)\n")
    local_run.run_here(["-m", "probe_rank", "a", "b"], 2, timeout_s=60, cwd=tmp_path)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert seen == {"argv": [str(tmp_path / "probe_rank.py"), "a", "b"], "path0": str(tmp_path)}
    with pytest.raises(LocalRunError, match="No module named no_such_module"):
        local_run.run_here(["-m", "no_such_module"], 2, timeout_s=60, cwd=tmp_path)


def test_the_rank_that_failed_says_the_cause_on_the_first_line():
    """Its peer's error says only the symptom (the connection it found closed); the failed rank's
    own one-line error leads, else the end of its traceback, where a warning quotes one line."""
    from autopart.tools.local_run import run_failed

    peer = "autopart: error on rank 1: RuntimeError: Connection closed by peer\n"
    traceback = "Traceback (most recent call last):\n  File \"stage_0.py\", line 9\nModuleNotFoundError: No module named 'm'\n"
    error = str(run_failed(1, traceback + peer, failed=traceback))
    assert error.splitlines()[0] == "the distributed run failed (exit 1): ModuleNotFoundError: No module named 'm'"
    own = "autopart: error on rank 0: out of memory\n"
    assert str(run_failed(1, own + peer, failed=own)).splitlines()[0].endswith("): autopart: error on rank 0: out of memory")
    assert str(run_failed(1, peer)).splitlines()[0].endswith("Connection closed by peer"), "none known: the errors written"


def test_the_runtime_entry_without_an_output_directory_is_one_line():
    import subprocess
    import sys

    from tests.distributed import environment

    for argv in ([], ["--help"]):
        result = subprocess.run([sys.executable, "-m", "autopart.runtime", *argv], capture_output=True, text=True,
                                timeout=60, env=environment())
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.startswith("usage: python -m autopart.runtime OUT") and result.stderr.count("\n") == 1


def test_a_free_port_lies_below_the_ports_the_kernel_hands_out():
    """A port the kernel handed out (a bind to port 0) went to another run's gloo connection
    before the rendezvous listened on it (EADDRINUSE, under two test workers); one below the
    ephemeral range can be taken only by a process that names it. Seeding Python's generator
    alike in two runs does not make them pick alike."""
    import random
    from pathlib import Path

    from autopart.tools.local_run import free_port

    lowest = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picks = []
    for _ in range(20):
        random.seed(0)
        picks.append(free_port())
    assert all(10_000 <= port < lowest for port in picks) and len(set(picks)) > 1
