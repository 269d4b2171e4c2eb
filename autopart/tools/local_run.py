"""Run a compile's programs on this machine: torchrun, loopback, a timeout; gloo on the CPU, or
NCCL on this machine's GPUs when the plan was compiled for a GPU and there is one per rank.

`autopart verify` and `autopart compile --profile-pipeline` both launch the generated
``train.py`` here; this is the one place that knows how.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from autopart.ir.plan import Plan

__all__ = ["LocalRunError", "free_port", "run_failed", "run_locally", "runs_on_gpus"]


class LocalRunError(RuntimeError):
    """The programs failed or did not finish; the message holds the end of their log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def runs_on_gpus(plan: Plan) -> bool:
    """Whether the plan's programs run on this machine's GPUs: it was compiled for a GPU (its
    cost model's device is not the CPU) and each of its ranks can have a GPU of its own here."""
    device = plan.provenance.cost_model.rpartition(":")[2]
    return device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() >= plan.world_size


def run_locally(
    out_dir: Path, ranks: int, train_args: list[str], *, timeout_s: float, cwd: Path, gpus: bool = False
) -> None:
    """``torchrun --nproc-per-node ranks out_dir/train.py train_args`` on this host, one GPU per
    rank with ``gpus``, else on the CPU (the GPUs hidden) with one thread per rank; raises
    `LocalRunError` when it fails or outlasts ``timeout_s``."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(out_dir / "train.py"),
        *train_args, "--timeout", str(min(timeout_s, 300)),
    ]  # fmt: skip
    env = dict(os.environ) if gpus else dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    package_root = str(Path(__file__).resolve().parents[2])  # the generated train.py imports autopart
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise LocalRunError(f"the distributed run did not finish within {timeout_s:.0f} s") from None
    if result.returncode != 0:
        raise run_failed(result.returncode, result.stderr)


def run_failed(code: int, stderr: str) -> LocalRunError:
    """The error of a run whose launcher exited with ``code``: the ranks' own one-line errors
    (``autopart: ...``) where they wrote any, else the end of what they wrote."""
    errors = [line for line in stderr.splitlines() if line.startswith("autopart:")]
    tail = "\n".join(errors) if errors else stderr[-3000:]
    return LocalRunError(f"the distributed run failed (exit {code}):\n{tail}")
