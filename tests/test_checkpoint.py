"""Checkpoints, resume, a rank failing under torchrun, consolidation, dead peers and launch checks.

One gpt compile (pp=2) and one uninterrupted 6-step run are shared by every test of the module;
the interrupted runs must reproduce that run bit for bit on the CPU.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from autopart.ir.model_file import eager_loss, load_model_file
from autopart.driver import CompileOptions, compile_to_directory
from autopart.tools.consolidate import consolidated_state
from autopart.runtime import train
from autopart.ir.errors import ConfigError
from autopart.runtime.checkpoint_folders import latest_checkpoint
from autopart.runtime.stage import load_stage
from autopart.runtime.data import global_batches
from tests.distributed import REPO, environment, free_port, read_metrics, run_cli_here, run_ranks, stage_weights

STEPS = 6


def launch(out: Path, *args: str, env: dict | None = None, restarts: int = 0, timeout: float = 240,
           monitor_interval: float = 0.1):
    """torchrun that may fail: the completed process, and how long it ran. ``monitor_interval``:
    how often torchrun looks at its workers (its default, 0.1 s), and so how soon after one
    fails it stops the others."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", f"--max-restarts={restarts}", f"--monitor-interval={monitor_interval}",
        str(out / "train.py"), *args,
    ]  # fmt: skip
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment() | (env or {}))
    return result, time.monotonic() - start


def train_args(folder: Path, optimizer: str, *extra: str) -> list[str]:
    lr = "0.1" if optimizer == "sgd" else "0.01"
    return ["--lr", lr, "--optimizer", optimizer, "--metrics", str(folder / "metrics.jsonl"),
            "--save-weights", str(folder / "final"), "--checkpoint-dir", str(folder / "ckpt"), *extra]  # fmt: skip


def losses_by_step(path: Path) -> list[float]:
    """The loss of every step; a step run again after a restart counts once, as last written."""
    by_step = {m["step"]: m["loss"] for m in read_metrics(path)}
    return [by_step[s] for s in sorted(by_step)]


def assert_identical(folder: Path, reference: Path) -> None:
    assert losses_by_step(folder / "metrics.jsonl") == losses_by_step(reference / "metrics.jsonl")
    finals, expected = stage_weights(folder / "final"), stage_weights(reference / "final")
    assert finals.keys() == expected.keys()
    for stage in expected:
        for name, value in expected[stage].items():
            assert torch.equal(finals[stage][name], value), f"stage {stage} {name} differs"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpt") / "out"
    compile_to_directory(
        CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b"),
        out,
    )
    return out


@pytest.fixture(scope="module")
def uninterrupted(compiled, tmp_path_factory) -> Path:
    """6 sgd steps with checkpoints after steps 5 and 6."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    run_ranks(compiled, 2, "--steps", str(STEPS), *train_args(folder, "sgd", "--checkpoint-every", "5"))
    return folder


@pytest.mark.multiprocess
def test_rank_killed_at_step_3_restarts_and_ends_identical(compiled, uninterrupted, tmp_path):
    result, _ = launch(compiled, "--steps", str(STEPS), "--timeout", "60",
                       *train_args(tmp_path, "sgd", "--checkpoint-every", "3"),
                       env={"AUTOPART_FAIL_AT": "1:3"}, restarts=1)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rank 1 dies at step 3" in result.stderr
    assert "resumed from" in result.stdout and "step_00000003" in result.stdout  # by itself: no --resume given
    assert_identical(tmp_path, uninterrupted)


@pytest.mark.multiprocess
def test_adamw_stop_after_step_3_and_resume_is_bit_identical(compiled, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir(), parts.mkdir()
    run_ranks(compiled, 2, "--steps", str(STEPS), *train_args(whole, "adamw"))
    run_ranks(compiled, 2, "--steps", "3", *train_args(parts, "adamw"))
    assert len(read_metrics(parts / "metrics.jsonl")) == 3
    resumed = run_ranks(compiled, 2, "--steps", str(STEPS), "--resume", *train_args(parts, "adamw"))
    assert "resumed from" in resumed.stdout
    assert "was saved by a run with" not in resumed.stderr, "a constant rate: more steps change nothing"
    assert_identical(parts, whole)


@pytest.mark.multiprocess
def test_resuming_past_the_steps_is_refused_and_weights_beside_a_checkpoint_are_named(compiled, uninterrupted,
                                                                                      tmp_path):
    """--resume from a checkpoint that already did --steps would train nothing and write none of
    its outputs; --weights beside a checkpoint to resume is not read, and the run says so."""
    result = run_ranks(compiled, 2, "--steps", "3", "--resume", "--optimizer", "sgd", "--checkpoint-dir",
                       str(uninterrupted / "ckpt"), check=False)
    assert result.returncode != 0
    assert f"--steps 3: the checkpoint resumed from had done {STEPS} steps already" in result.stderr, result.stderr[-3000:]
    folder = shutil.copytree(uninterrupted / "ckpt", tmp_path / "ckpt")
    whole = tmp_path / "whole.safetensors"
    save_file({name: value for stage in stage_weights(compiled / "weights").values() for name, value in stage.items()},
              str(whole))
    result = run_ranks(compiled, 2, "--steps", str(STEPS + 1), "--resume", "--optimizer", "sgd", "--checkpoint-dir",
                       str(folder), "--weights", str(whole))
    assert "resumed from a checkpoint, so --weights" in result.stderr and "lr_scheduler" not in result.stderr


@pytest.mark.multiprocess
def test_another_compile_s_checkpoint_is_refused_with_the_way_to_its_weights(uninterrupted, tmp_path):
    other = tmp_path / "other"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=4, micro_batch_size=1),
                         other)
    result = run_ranks(other, 2, "--steps", "2", "--resume", "--checkpoint-dir", str(uninterrupted / "ckpt"), check=False)
    assert result.returncode != 0
    assert f"was saved by another compile than {other}" in result.stderr, result.stderr[-3000:]
    assert f"autopart consolidate {uninterrupted / 'ckpt'} -o model.safetensors" in result.stderr


@pytest.mark.multiprocess
def test_a_stage_of_the_loss_alone_trains_like_one_process_and_resumes(tmp_path):
    """A cut may leave a stage nothing but the loss (no parameter): its ranks' optimizer has one
    empty group (torch refuses no group at all) and steps nothing, with ZeRO-1 over two replicas;
    a checkpoint of it resumes to the same run. The model is one linear layer, so that the only
    cut there is falls before its loss (a model of layers is cut between them)."""
    from autopart.tools.verify import verify

    model = REPO / "tests" / "models" / "one_linear.py"
    out = tmp_path / "out"
    plan, _ = compile_to_directory(
        CompileOptions(model=model, pp=2, dp=2, zero=True, microbatches=2, global_batch_size=4), out
    )
    assert plan.stages[-1].parameters == () and plan.stages[0].parameters
    result = verify(out, steps=2)
    assert result.matches, result.failures
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir(), parts.mkdir()
    run_ranks(out, 4, "--steps", "3", *train_args(whole, "adamw"))
    run_ranks(out, 4, "--steps", "2", *train_args(parts, "adamw"))
    assert "resumed from" in run_ranks(out, 4, "--steps", "3", "--resume", *train_args(parts, "adamw")).stdout
    assert_identical(parts, whole)


@pytest.mark.multiprocess
def test_a_rank_that_trained_to_the_end_runs_its_exit_handlers_and_exits_zero(compiled, tmp_path):
    """The generated program leaves past the interpreter's teardown (`autopart.runtime.train.leave`),
    but as a normal exit would: an exit handler registered at start-up runs on every rank."""
    hooks, marks = tmp_path / "hooks", tmp_path / "marks"
    hooks.mkdir()
    marks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import atexit, os, pathlib\n"
        "if 'RANK' in os.environ and 'AUTOPART_TEST_MARKS' in os.environ:\n"
        "    mark = pathlib.Path(os.environ['AUTOPART_TEST_MARKS']) / os.environ['RANK']\n"
        "    atexit.register(mark.write_text, 'ran')\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(hooks), environment()["PYTHONPATH"]]), "AUTOPART_TEST_MARKS": str(marks)}
    result, _ = launch(compiled, "--steps", "1", env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(mark.name for mark in marks.iterdir()) == ["0", "1"]


@pytest.mark.multiprocess
def test_consolidated_weights_give_the_last_steps_loss(uninterrupted, tmp_path):
    output = tmp_path / "model.safetensors"
    result = run_cli_here("consolidate", str(uninterrupted / "ckpt" / "step_00000005"), "-o", str(output),
                          "--model", str(REPO / "examples" / "gpt.py"))
    assert result.returncode == 0, result.stderr
    spec = load_model_file(REPO / "examples" / "gpt.py")
    state = load_file(str(output))
    assert set(state) == set(spec.module.state_dict()) and "lm_head.weight" in state  # tied: both names
    spec.module.load_state_dict(state, strict=True)
    batches = global_batches(spec, 4, 0)
    for _ in range(STEPS - 1):
        next(batches)
    with torch.no_grad():
        loss = eager_loss(spec, *next(batches)).item()
    last = read_metrics(uninterrupted / "metrics.jsonl")[-1]
    assert last["step"] == STEPS - 1
    assert loss == pytest.approx(last["loss"], rel=1e-6)


@pytest.mark.multiprocess
def test_saved_weights_name_their_plan_and_a_rerun_replaces_its_own(compiled, uninterrupted, tmp_path):
    """--save-weights replaced whatever stage files its folder held: the user's own, another
    compile's (now refused: tests/test_bad_inputs_of_outputs.py). The files it writes name their
    plan, so that a rerun of the same plan over its own saved weights replaces them."""
    from safetensors import safe_open

    from autopart.runtime.launch import PLAN_HASH_KEY, plan_digest

    final = shutil.copytree(uninterrupted / "final", tmp_path / "final")
    for path in sorted(final.glob("stage_*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            assert (handle.metadata() or {}).get(PLAN_HASH_KEY) == plan_digest(compiled / "plan.json"), path.name
    before = stage_weights(final)
    run_ranks(compiled, 2, "--steps", "1", "--save-weights", str(final))
    after = stage_weights(final)
    assert after.keys() == before.keys()
    assert any(not torch.equal(after[s][name], value) for s in before for name, value in before[s].items())


@pytest.mark.multiprocess
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(uninterrupted, tmp_path):
    root = shutil.copytree(uninterrupted / "ckpt", tmp_path / "ckpt")
    (root / ".step_00000007.partial").mkdir()  # a save that crashed: never a candidate
    damaged = root / "step_00000006" / "__0_0.distcp"
    damaged.write_bytes(damaged.read_bytes()[:-100])
    path, skipped = latest_checkpoint(root)
    assert path == root / "step_00000005"
    assert skipped == [f"checkpoint {root / 'step_00000006'} is damaged (__0_0.distcp does not match its sha256); "
                       "falling back to an earlier one"]  # fmt: skip
    _, summary = consolidated_state(root, REPO / "examples" / "gpt.py")
    assert summary.step == 5 and summary.skipped == tuple(skipped)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["", ":hang"])
def test_dead_or_stuck_peer_ends_the_job_with_the_failing_action(compiled, tmp_path, mode):
    """The survivor says which of its actions the dead or silent peer left failing. torchrun stops
    the survivors once it sees a rank fail (every 0.1 s by default): on a loaded machine that may
    come before rank 0 is scheduled to report (the suite saw it once), so here torchrun looks every
    5 s, which leaves the report time without changing what it says.

    ``--timeout`` bounds every wait of the run, the healthy ones too (the rendezvous of ranks that
    a loaded machine starts seconds apart): a dead peer's closed connection ends the survivor's
    wait at once, so that run waits as long as a real one would; a silent peer is found only by
    the timeout, so that run's is short enough to wait for, and well above any healthy wait."""
    timeout = 20 if mode else 120
    result, seconds = launch(compiled, "--steps", "4", "--timeout", str(timeout),
                             env={"AUTOPART_FAIL_AT": f"1:1{mode}"}, monitor_interval=5.0)
    assert result.returncode != 0
    # a silent peer leaves the first receive waiting; a dead one's closed connection fails whichever
    # message of the step meets it first, a send posted earlier (waited for later) too
    action = "microbatch 0, action 0RECV_B0" if mode else r"microbatch \d+, action 0(RECV|SEND)_[FB]\d+"
    assert re.search(f"autopart: error on rank 0: rank 0, stage 0, {action}", result.stderr), result.stderr[-3000:]
    assert "<-- ERROR HERE (rank 0)" in result.stderr
    if mode:
        assert "Timed out" in result.stderr
    else:  # found by the closed connection, not by waiting out the timeout
        assert seconds < timeout - 10, f"took {seconds:.0f} s"


@pytest.mark.multiprocess
def test_a_failed_rank_says_where_before_any_teardown(compiled, tmp_path):
    """A rank whose action failed leaves without tearing its process group down: on NCCL the
    teardown waits for every queued kernel, the dead peer's receive among them, so its line would
    come only after the watchdog's abort. The ranks' check writes a line at each
    ``destroy_process_group``; the failed rank must write none."""
    report = tmp_path / "destroyed.jsonl"
    result = run_ranks(compiled, 2, "--steps", "3", "--timeout", "10", check=False,
                       env={"AUTOPART_FAIL_AT": "1:1:hang", "AUTOPART_DEVICE_CHECK": str(report)})  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "autopart: error on rank 0: rank 0, stage 0, microbatch 0, action 0RECV_B0" in result.stderr
    destroyed = [json.loads(line)["rank"] for line in report.read_text().splitlines()] if report.exists() else []
    assert 0 not in destroyed


@pytest.mark.multiprocess
def test_a_peer_that_dies_during_a_save_ends_the_job_in_one_line(compiled, tmp_path):
    """The survivor, waiting in the save's collectives, says where it was, not the collective
    library's traceback; the checkpoint before it stays the latest good one."""
    result, _ = launch(compiled, "--steps", "4", "--timeout", "120", "--checkpoint-dir", str(tmp_path / "ckpt"),
                       "--checkpoint-every", "1", env={"AUTOPART_FAIL_AT": "1:1:save"}, monitor_interval=5.0)
    assert result.returncode != 0
    assert "autopart: error on rank 0: rank 0, saving the checkpoint after step 1: " in result.stderr, \
        result.stderr[-3000:]
    assert "[rank0]: Traceback" not in result.stderr
    assert latest_checkpoint(tmp_path / "ckpt")[0].name == "step_00000001"


@pytest.mark.multiprocess
def test_a_rank_killed_by_a_signal_says_where_it_was(compiled):
    """An abort inside a C++ library leaves no Python traceback of its own; the rank's stack is
    what tells a user (and a CI log) where it died."""
    result, _ = launch(compiled, "--steps", "3", "--timeout", "120", env={"AUTOPART_FAIL_AT": "1:1:abort"})
    assert result.returncode != 0
    assert "Fatal Python error: Aborted" in result.stderr
    assert 'in inject_failure' in result.stderr and 'in _loop' in result.stderr


def launch_here(out: Path, monkeypatch, capsys, *args: str, rank: int = 0, world_size: int = 2) -> str:
    """train.py's launch checks, in this process: they all run before any collective."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit) as exit_info:
        train.main(out, ["--steps", "1", *args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("autopart: error: ") and error.count("\n") == 1
    return error


@pytest.mark.parametrize("damage", ["world size", "stage file", "edited stage file", "edited model file", "weights",
                                    "other compile", "used checkpoint dir", "one checkpoint as the dir"])
def test_launch_checks(compiled, tmp_path, monkeypatch, capsys, damage):
    out = shutil.copytree(compiled, tmp_path / "out")
    if damage == "one checkpoint as the dir":  # its saves would go inside it, and every resume take it again
        one = tmp_path / "ckpt" / "step_00000002"
        one.mkdir(parents=True)
        (one / "autopart.json").write_text("{}")
        for extra in ((), ("--resume",)):
            error = launch_here(out, monkeypatch, capsys, "--checkpoint-dir", str(one), *extra)
            assert "is one checkpoint, not a folder of them: give the folder it is in" in error
    elif damage == "used checkpoint dir":  # a run from step 0 would interleave its saves with the earlier run's
        root = tmp_path / "ckpt"
        (root / "step_00000004").mkdir(parents=True)
        (root / "step_00000004" / "autopart.json").write_text("{}")
        error = launch_here(out, monkeypatch, capsys, "--checkpoint-dir", str(root))
        assert f"--checkpoint-dir {root} already holds checkpoints of an earlier run (the latest step_00000004)" in error
        assert "add --resume" in error and (root / "step_00000004" / "autopart.json").read_text() == "{}"
    elif damage == "world size":
        assert "the plan needs 2 processes but 3 were started" in launch_here(out, monkeypatch, capsys, world_size=3)
    elif damage == "stage file":
        (out / "stages" / "stage_1.py").unlink()
        assert "rank 1 needs stages/stage_1.py of stage 1" in launch_here(out, monkeypatch, capsys, rank=1)
    elif damage == "edited stage file":  # one added line would run on rank 1 unchecked
        stage = out / "stages" / "stage_1.py"
        stage.write_text(stage.read_text() + "\nopen('SENTINEL', 'w')\n")
        error = launch_here(out, monkeypatch, capsys, rank=1)
        assert "stages/stage_1.py in" in error and "is not the file that autopart compile wrote" in error
        assert "recompile with autopart compile" in error
        with pytest.raises(ConfigError, match="is not the file that autopart compile wrote"):
            load_stage(out, 1, torch.device("cpu"))  # the loader checks the bytes it executes, too
        assert not (tmp_path / "SENTINEL").exists() and not Path("SENTINEL").exists()
    elif damage == "edited model file":
        (out / "model.py").write_text((out / "model.py").read_text() + "\n# mine\n")
        error = launch_here(out, monkeypatch, capsys)
        assert "model.py in" in error and "is not the model file that was compiled" in error and "recompile" in error
    elif damage == "weights":
        (out / "weights" / "stage_0.safetensors").unlink()
        assert "rank 0 needs weights/stage_0.safetensors" in launch_here(out, monkeypatch, capsys)
    else:
        plan = out / "plan.json"
        plan.write_text(plan.read_text().replace('"bubble": ', '"bubble": 1', 1))  # any edit of a value: another compile's
        assert "was not written by the compile that wrote plan.json" in launch_here(out, monkeypatch, capsys)
