"""Launching generated programs in tests (their ranks forked, or under torchrun where the launcher
is what a test checks): a free loopback port per launch and a timeout on every launch, so that nothing can hang CI; and the compile-train-compare helpers
that every equivalence test shares."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from autopart.driver import CompileOptions, compile_to_directory
from autopart.tools.local_run import RankZygote, free_port, run_forked
from autopart.ir.plan import Plan
from autopart.runtime.recipe import Recipe
from autopart.runtime.reference import train_reference

REPO = Path(__file__).resolve().parent.parent
FREE_LINKS = REPO / "tests" / "devices" / "free-links.toml"  # collectives cost nothing: every op that can split does


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def torchrun(out: Path, nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC out/train.py ARGS``, as a user runs it: the launcher's own
    agent, its rendezvous and its restarts."""
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(out / "train.py"), "--timeout", "120", *args,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment())
    if result.returncode != 0:
        raise AssertionError(f"torchrun failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def run_ranks(
    out: Path, nproc: int, *args: str, timeout: float = 240, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """The ranks of ``out/train.py``, each with the environment torchrun gives its workers (RANK,
    WORLD_SIZE, MASTER_ADDR, ...) and the same gloo rendezvous, forked by ``tests/rank_zygote.py``
    from a process that has imported torch once, instead of each importing it under torchrun's
    agent (which imports it too). Tests of the launcher itself (restarts, the README's command)
    use ``torchrun``. ``env``: more variables for every rank. The completed process carries every
    rank's output, in rank order. ``check`` False: a failed rank is the returned process's
    ``returncode`` (its own exit code), not an AssertionError."""
    return run_program([str(out / "train.py"), "--timeout", "120", *args], nproc, timeout=timeout, env=env,
                       check=check)


def run_program(argv: list[str], nproc: int, *, timeout: float = 240,
                env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``nproc`` ranks of the program ``argv`` (a script and its arguments), forked as `run_ranks`
    forks a ``train.py``'s."""
    launched = run_forked(_ZYGOTE, argv, nproc, environment(), timeout_s=timeout, extra=env)
    stdout = "".join(launched.stdouts)
    stderr = "".join(f"[rank {rank}] {text}" for rank, text in enumerate(launched.stderrs) if text)
    if launched.timed_out:
        raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
    if launched.failed_rank is not None and check:
        raise AssertionError(f"ranks failed (exit codes {launched.codes}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    code = 0 if launched.failed_rank is None else launched.codes[launched.failed_rank]
    return subprocess.CompletedProcess(argv, code, stdout=stdout, stderr=stderr)


_ZYGOTE = RankZygote([sys.executable, str(REPO / "tests" / "rank_zygote.py")], env=environment())
"""The suite's: `autopart.runtime.rank_zygote` with the device check of tests/device_checker.py."""


def train_whole_and_resumed(out: Path, nproc: int, tmp_path: Path) -> dict[str, Path]:
    """Train ``out`` 4 steps of AdamW in one launch ("whole") and in two, 2 then 2 resumed from
    the checkpoint ("parts"); each folder holds metrics.jsonl, final/ and ckpt/."""
    runs = {}
    for name, steps in (("whole", ["4"]), ("parts", ["2", "4"])):
        folder = tmp_path / name
        folder.mkdir()
        for count in steps:
            run_ranks(out, nproc, "--steps", count, "--lr", "0.01", "--optimizer", "adamw", "--metrics",
                      str(folder / "metrics.jsonl"), "--save-weights", str(folder / "final"), "--checkpoint-dir",
                      str(folder / "ckpt"), *(["--resume"] if count == "4" and name == "parts" else []))  # fmt: skip
        runs[name] = folder
    return runs


def replica_model() -> torch.nn.Module:
    """A small model (two widths, a norm, an activation) that every replica builds alike: the
    distributed optimizers' tests step it beside a plain optimizer's copy."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 4))


@contextlib.contextmanager
def gloo_group(rank: int, port: int, world_size: int):
    """A rank's gloo group on loopback (`fork_ranks`). Its ranks meet at a barrier before
    they destroy it: gloo can abort a rank whose peer closed first."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def leave_after(target, rank: int, port: int, *args) -> None:
    """One rank of `fork_ranks`: ``target``, then out through ``os._exit``. A rank that has met its
    peers at a barrier and destroyed its group can still abort in the interpreter's teardown
    ("terminate called without an active exception", no Python frame left: torch's C++ teardown of
    gloo), which is not what these tests check; faulthandler prints the stack of an abort before
    that point."""
    import faulthandler
    import traceback

    faulthandler.enable()
    code = 0
    try:
        target(rank, port, *args)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fork_ranks(target, world_size: int, *args, timeout: float = 120) -> list[int | None]:
    """Run ``target(rank, port, *args)`` in ``world_size`` ranks of a gloo group on a free loopback
    port, forked by the suite's zygote (tests/target_rank.py: ``target`` is found by its module and
    name, ``args`` are plain values or paths); their exit codes (-9: stopped, as a peer had failed
    or the time ran out), their output written to this process's. The zygote forks a process that
    has done nothing but import torch: a fork of the suite's long-lived process, which has run
    torch's thread pools and gloo, can hang in the child (it did, once in a clean CI run)."""
    encoded = json.dumps([{"path": str(a)} if isinstance(a, Path) else a for a in args])
    launched = run_forked(_ZYGOTE, [str(REPO / "tests" / "target_rank.py"), target.__module__, target.__name__, encoded],
                          world_size, environment(), timeout_s=timeout)
    sys.stdout.write("".join(launched.stdouts))
    sys.stderr.write("".join(f"[rank {rank}] {text}" for rank, text in enumerate(launched.stderrs) if text))
    return list(launched.codes)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stage_weights(folder: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {int(p.stem.split("_")[1]): load_file(str(p)) for p in sorted(folder.glob("stage_*.safetensors"))}


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autopart.tools.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=environment(), cwd=cwd or REPO,
    )  # fmt: skip


def run_cli_here(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``autopart ARGS`` in this process, as `run_cli` returns it (the exit code, what it printed,
    the warnings it raised among it): what the command does, without a process of its own to
    start and import torch in. Past ``timeout`` seconds it raises, as `run_cli` would; the
    logger the command sets up for its notes is put back as it was."""
    import logging
    import signal
    import warnings

    from autopart.tools.cli import main

    def expire(signum, frame):
        raise TimeoutError(f"autopart {' '.join(args)} took over {timeout:g} s")

    logger = logging.getLogger("autopart")
    handlers, level = list(logger.handlers), logger.level
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(timeout)))
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), \
                warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("default")  # a new process's filters: each warning once, none of these
            for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", hidden)
            try:
                main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        for warning in raised:  # where a process of its own would have printed them
            stderr.write(warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        logger.handlers[:], logger.level = handlers, level
    return subprocess.CompletedProcess(["autopart", *args], code, stdout=stdout.getvalue(), stderr=stderr.getvalue())


@dataclass(frozen=True, kw_only=True)
class Trained:
    """A compiled plan after a training run: what it printed and what it left."""

    plan: Plan
    out: Path
    metrics: list[dict]
    finals: dict[int, dict[str, torch.Tensor]]  # stage -> its final weights
    steps: int
    trace: Path | None  # the measured timeline of the last step, when asked for


def compile_and_train(
    tmp_path: Path, example: str | Path, *, pp: int, microbatches: int, schedule: str, optimizer: str = "sgd",
    lr: float = 0.1, chunks: int = 1, steps: int = 3, micro_batch_size: int = 2, trace: bool = False,
    train_args: tuple[str, ...] = (), launcher: str = "ranks", env: dict[str, str] | None = None, **options,
) -> Trained:
    """Compile ``examples/<example>.py`` (or the model file at a path) and train it for ``steps``
    in one launch (``run_ranks``, or the real ``torchrun`` with ``launcher="torchrun"``); ``options``
    are more CompileOptions, ``train_args`` more train.py flags, ``env`` more variables for the ranks."""
    out = tmp_path / "out"
    model = example if isinstance(example, Path) else REPO / "examples" / f"{example}.py"
    plan, _ = compile_to_directory(
        CompileOptions(model=model, pp=pp, microbatches=microbatches, micro_batch_size=micro_batch_size,
                       schedule=schedule, chunks=chunks, optimizer=optimizer, **options),
        out,
    )
    metrics = tmp_path / "metrics.jsonl"
    trace_path = tmp_path / "measured.json" if trace else None
    launch = torchrun if launcher == "torchrun" else functools.partial(run_ranks, env=env)
    launch(out, plan.world_size, "--steps", str(steps), "--lr", str(lr), "--optimizer", optimizer,
             "--metrics", str(metrics), "--save-weights", str(tmp_path / "final"),
             *(["--trace", str(trace_path)] if trace_path else []), *train_args)
    return Trained(plan=plan, out=out, metrics=read_metrics(metrics), finals=stage_weights(tmp_path / "final"),
                   steps=steps, trace=trace_path)


def assert_same_training(
    run: Trained, *, optimizer: str, lr: float, param_atol: float = 1e-6, weights: Path | None = None,
    recipe: Recipe | None = None,
) -> None:
    """Every step's loss and every final parameter equal a single-process run's on the same batches
    (started from the checkpoint ``weights`` when the programs were; with train.py's ``recipe``)."""
    reference = train_reference(run.out, steps=run.steps, lr=lr, optimizer=optimizer, weights=weights, recipe=recipe,
                                watch_buffers=True)
    assert not reference.unlisted_moves, f"buffers that move and that no stage file lists: {reference.unlisted_moves}"
    assert [m["step"] for m in run.metrics] == list(range(run.steps))
    torch.testing.assert_close(
        torch.tensor([m["loss"] for m in run.metrics], dtype=torch.float64),
        torch.tensor(reference.losses, dtype=torch.float64), rtol=1e-5, atol=1e-6,
    )
    seen = set()
    for stage, weights in run.finals.items():
        for name, value in weights.items():
            seen.add(name)
            torch.testing.assert_close(value, reference.parameters[name], rtol=1e-5, atol=param_atol, msg=name)
    assert seen == set(reference.parameters), "every parameter lives on some stage"
    for name, holders in run.plan.tied_parameters.items():
        copies = [run.finals[s][name] for s in holders]
        for copy in copies[1:]:
            assert torch.equal(copy, copies[0]), f"tied copies of {name} differ"
