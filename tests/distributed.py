"""Launching generated programs under torchrun in tests: a free loopback port per launch and a
timeout on every launch, so that nothing can hang CI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

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
