"""Bad inputs of what this machine or a cluster has: memory past a machine's or a device's, more
ranks than cores, NCCL without GPUs. As in tests/test_bad_inputs.py, each ends as one line naming
the problem and what to do, exit code 2, no traceback."""

import re
import subprocess
import sys

import pytest

from autopart.ir.errors import gib_beside
from tests.distributed import REPO, environment, run_cli
from tests.refusals import call_cli
from tests.test_bad_inputs import GOOD_BATCH


def test_a_need_just_above_the_limit_prints_above_it():
    """The out-of-memory messages print the need rounded up, to as many figures as tell it from the limit."""
    gib = 1 << 30
    assert gib_beside(862951728, round(0.803 * gib)) == ("0.8037", "0.803")
    assert gib_beside(round(79.6481 * gib), round(79.6472 * gib)) == ("79.6481", "79.6472")
    assert gib_beside(335000000, round(0.0001 * gib)) == ("0.312", "0.0001")


def test_profile_comm_starts_no_more_processes_than_cores(capsys, monkeypatch):
    """Each gloo rank of profile-comm is a process of this machine: ``--ranks 100000`` (a typo of
    10) started them all, a fork bomb, where past one per core they measure the cores taking turns."""
    import cost_models.comm_profile as comm_profile
    from cost_models.calibration import usable_cores

    monkeypatch.setattr(comm_profile, "run_here", lambda *args, **kwargs: pytest.fail("profile-comm started its ranks"))
    ranks = max(2, usable_cores()) + 1
    line = call_cli(capsys, "profile-comm", "--ranks", str(ranks), "--backend", "gloo")
    assert re.search(rf"--ranks {ranks} would start {ranks} processes on this machine's \d+ cores?, .*; use --ranks "
                     rf"{ranks - 1} or fewer$", line), line


def test_profile_comm_on_nccl_without_two_gpus_points_to_gloo(capsys, monkeypatch):
    """'use fewer --ranks' was no way out: 2 is the fewest, and a machine without GPUs measures with gloo."""
    import cost_models.comm_profile as comm_profile

    monkeypatch.setattr(comm_profile.torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(comm_profile, "run_here", lambda *args, **kwargs: pytest.fail("profile-comm started its ranks"))
    line = call_cli(capsys, "profile-comm", "--backend", "nccl")
    assert re.search(r"nccl over 2 ranks needs 2 GPUs, 0 visible; use --backend gloo for this machine's CPU, or a "
                     r"machine of 2 GPUs$", line), line


HUGE_BATCH = 10**12  # gpt's samples take 512 bytes each: 466 TiB, past any machine's memory


@pytest.mark.parametrize("how", ["cli", "cli_searched", "api"])
def test_a_global_batch_past_the_machine_s_memory_is_refused_before_it_is_built(tmp_path, how):
    """``--global-batch-size 1000000000`` hung: in counting up to it for the batch's divisors, then
    in an example batch of half a billion rows (the micro-batch), or under the search in a schedule
    of millions of microbatches. Every rank of train.py draws each global batch whole: one larger
    than this machine's memory is refused in one line, from the bytes of one example sample."""
    out = tmp_path / "out"
    gpt = REPO / "examples" / "gpt.py"
    if how == "api":
        code = ("import sys, autopart\n"
                f"try:\n    autopart.compile({str(gpt)!r}, global_batch_size={HUGE_BATCH})\n"
                "except autopart.AutopartError as error:\n"
                "    print(f'autopart: error: {error}', file=sys.stderr)\n    sys.exit(2)\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90,
                                env=environment(), cwd=REPO)  # fmt: skip
    else:
        searched = ["--world-size", "2"] if how == "cli_searched" else []
        result = run_cli("compile", str(gpt), "-o", str(out), "--global-batch-size", str(HUGE_BATCH), *searched,
                         timeout=90)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    ranks = "the 2 ranks here each draw" if how == "cli_searched" else "the rank here draws"
    assert re.fullmatch(rf"autopart: error: {ranks} every global batch \(1000000000000 samples\) whole: [\d,]+\.\d GiB "
                        r"of gpt\.py's samples \(512 bytes each\), more than this machine's [\d.]+ GiB of memory; give a "
                        r"smaller --global-batch-size\n", result.stderr), result.stderr
    assert not out.exists()


def test_a_global_batch_for_a_remote_cluster_is_bounded_by_what_the_compile_builds(tmp_path):
    """Compiled for a remote device, the ranks draw their batches on the cluster's nodes: this
    machine builds example batches of the micro-batch size only. A global batch larger than its
    memory compiles; a micro-batch larger is refused, and so are more microbatches a step than a
    schedule is laid out for (a million of them took minutes)."""
    import os

    sample = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 256  # 512 samples: twice the memory
    path = tmp_path / "volumes.py"
    path.write_text(GOOD_BATCH.replace("torch.randn(batch_size, 8)", f"torch.zeros(batch_size, {sample // 4})")
                    + "class Head(torch.nn.Linear):\n    def forward(self, x):\n        return super().forward(x[:, :8])\n"
                    + "def build_model():\n    return Head(8, 4)\n")  # fmt: skip
    gib = "--micro-batch-size"
    common = [str(path), "--device", "a100-80gb", "--no-measure"]
    result = run_cli("compile", *common, "-o", str(tmp_path / "out"), "--dp", "8", "--global-batch-size", "512",
                     "--micro-batch-size", "2", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli("compile", *common, "-o", str(tmp_path / "big"), "--global-batch-size", "512", timeout=300)
    assert result.returncode == 2 and re.fullmatch(
        r"autopart: error: the compile builds example batches of the micro-batch size, 256 samples: .* more than this "
        rf"machine's [\d.]+ GiB of memory; give a smaller {gib}\n", result.stderr), result.stderr
    result = run_cli("compile", str(REPO / "examples" / "gpt.py"), "-o", str(tmp_path / "many"), "--device", "a100-80gb",
                     "--global-batch-size", str(1 << 20), "--micro-batch-size", "1", timeout=300)
    assert result.returncode == 2 and "1048576 microbatches a step per data-parallel replica is more than the 16384 a " \
        "schedule is laid out for; give a --micro-batch-size of at least 64\n" in result.stderr, result.stderr
    assert not (tmp_path / "big").exists() and not (tmp_path / "many").exists()
