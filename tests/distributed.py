"""Launching generated programs under torchrun in tests: a free loopback port per launch and a
timeout on every launch, so that nothing can hang CI; and the compile-train-compare helpers
that every equivalence test shares."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from autopart.compiler import CompileOptions, compile_to_directory
from autopart.plan import Plan
from autopart.runtime.reference import train_reference

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def torchrun(out: Path, nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(out / "train.py"), "--timeout", "120", *args,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment())
    if result.returncode != 0:
        raise AssertionError(f"torchrun failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stage_weights(folder: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {int(p.stem.split("_")[1]): load_file(str(p)) for p in sorted(folder.glob("stage_*.safetensors"))}


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autopart.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=environment(), cwd=cwd or REPO,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Trained:
    """A compiled plan after a torchrun training run: what it printed and what it left."""

    plan: Plan
    out: Path
    metrics: list[dict]
    finals: dict[int, dict[str, torch.Tensor]]  # stage -> its final weights
    steps: int
    trace: Path | None  # the measured timeline of the last step, when asked for


def compile_and_train(
    tmp_path: Path, example: str | Path, *, pp: int, microbatches: int, schedule: str, optimizer: str = "sgd",
    lr: float = 0.1, chunks: int = 1, steps: int = 3, micro_batch_size: int = 2, trace: bool = False,
    train_args: tuple[str, ...] = (), **options,
) -> Trained:
    """Compile ``examples/<example>.py`` (or the model file at a path) and train it for ``steps``
    under one torchrun launch; ``options`` are more CompileOptions, ``train_args`` more train.py flags."""
    out = tmp_path / "out"
    model = example if isinstance(example, Path) else REPO / "examples" / f"{example}.py"
    plan, _ = compile_to_directory(
        CompileOptions(model=model, pp=pp, microbatches=microbatches, micro_batch_size=micro_batch_size,
                       schedule=schedule, chunks=chunks, optimizer=optimizer, **options),
        out,
    )
    metrics = tmp_path / "metrics.jsonl"
    trace_path = tmp_path / "measured.json" if trace else None
    torchrun(out, pp, "--steps", str(steps), "--lr", str(lr), "--optimizer", optimizer,
             "--metrics", str(metrics), "--save-weights", str(tmp_path / "final"),
             *(["--trace", str(trace_path)] if trace_path else []), *train_args)
    return Trained(plan=plan, out=out, metrics=read_metrics(metrics), finals=stage_weights(tmp_path / "final"),
                   steps=steps, trace=trace_path)


def assert_same_training(
    run: Trained, *, optimizer: str, lr: float, param_atol: float = 1e-6, weights: Path | None = None
) -> None:
    """Every step's loss and every final parameter equal a single-process run's on the same batches
    (started from the checkpoint ``weights`` when the programs were)."""
    reference = train_reference(run.out, steps=run.steps, lr=lr, optimizer=optimizer, weights=weights)
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
