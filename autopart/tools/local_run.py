"""Run a compile's programs on this machine: loopback, a timeout; gloo on the CPU, or NCCL on
this machine's GPUs when the plan was compiled for a GPU and there is one per rank.

`autopart verify`, a pipeline's profile and a search's finalists all launch the generated
``train.py`` here; this is the one place that knows how. On the GPUs the ranks start under
torchrun, as a user starts them. On the CPU they are forked from a process of this compile that
has imported torch once (`autopart.runtime.rank_zygote`): torchrun's agent and every rank would
import it again, seconds of a 2-core machine per launch, and a compile may launch a dozen times.
A forked rank has torchrun's environment and runs ``train.py`` as torchrun's would.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from autopart.ir.plan import Plan

__all__ = ["LocalRunError", "RankZygote", "free_port", "run_failed", "run_forked", "run_locally", "runs_on_gpus"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the generated train.py imports autopart


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
    out_dir: Path, ranks: int, train_args: list[str], *, timeout_s: float, cwd: Path, gpus: bool = False,
    forked: bool | None = None,
) -> None:
    """``out_dir/train.py train_args`` on ``ranks`` ranks of this host, one GPU per rank with
    ``gpus``, else on the CPU (the GPUs hidden) with one thread per rank; raises `LocalRunError`
    when it fails or outlasts ``timeout_s``. ``forked``: the ranks forked from this compile's
    rank zygote (the default on the CPU) or started by torchrun (on the GPUs, always)."""
    argv = [str(out_dir / "train.py"), *train_args, "--timeout", str(min(timeout_s, 300))]
    env = dict(os.environ) if gpus else dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    if gpus or forked is False:
        _torchrun(argv, ranks, env, timeout_s=timeout_s, cwd=cwd)
    else:
        _forked(argv, ranks, env, timeout_s=timeout_s, cwd=cwd)


def _torchrun(argv: list[str], ranks: int, env: dict[str, str], *, timeout_s: float, cwd: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", *argv]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise _timed_out(timeout_s) from None
    if result.returncode != 0:
        raise run_failed(result.returncode, result.stderr)


def _forked(argv: list[str], ranks: int, env: dict[str, str], *, timeout_s: float, cwd: Path) -> None:
    answer, _, stderrs = run_forked(_ZYGOTE, argv, ranks, env, timeout_s=timeout_s, cwd=cwd)
    if answer["timed_out"]:
        raise _timed_out(timeout_s)
    if any(answer["codes"]):
        raise run_failed(next(code for code in answer["codes"] if code), "".join(stderrs))


def _timed_out(timeout_s: float) -> LocalRunError:
    return LocalRunError(f"the distributed run did not finish within {timeout_s:.0f} s")


class RankZygote:
    """A `autopart.runtime.rank_zygote` process (``command``, with this process's pid added),
    started at its first launch and again after one that did not end cleanly: it died, or its
    answer was not read (Ctrl-C, say), in which case it is killed and its ranks end with it."""

    def __init__(self, command: list[str] | None = None, env: dict[str, str] | None = None):
        self.command = command or [sys.executable, "-m", "autopart.runtime.rank_zygote"]
        self.env = env
        self.process: subprocess.Popen | None = None
        atexit.register(self.close)

    def launch(self, request: dict) -> dict:
        """Its answer to ``request`` (the protocol is `autopart.runtime.rank_zygote`'s)."""
        if self.process is None or self.process.poll() is not None:
            env = self.env or dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
            self.process = subprocess.Popen([*self.command, str(os.getpid())], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        process = self.process
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            answer = process.stdout.readline()
            if not answer:
                raise LocalRunError(f"the process that starts the ranks ended (exit {process.wait()})")
            return json.loads(answer)
        except BaseException:
            process.kill()
            process.wait()
            raise

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


_ZYGOTE = RankZygote()  # no process until this compile's first run on the CPU


def run_forked(zygote: RankZygote, argv: list[str], ranks: int, env: dict[str, str], *, timeout_s: float,
               cwd: Path | None = None, extra: dict[str, str] | None = None) -> tuple[dict, list[str], list[str]]:
    """``ranks`` ranks of the program ``argv`` forked by ``zygote`` on loopback, each with ``env``,
    then torchrun's variables for its workers, then ``extra``: the zygote's answer, and each
    rank's stdout and stderr."""
    port = free_port()
    envs = [{**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
             "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "ROLE_WORLD_SIZE": str(ranks),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", **(extra or {})}
            for rank in range(ranks)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="autopart-ranks-") as folder:
        outputs = [[f"{folder}/{rank}.out", f"{folder}/{rank}.err"] for rank in range(ranks)]
        answer = zygote.launch({"argv": argv, "envs": envs, "outputs": outputs, "timeout": timeout_s,
                                "cwd": None if cwd is None else str(cwd)})
        return answer, [Path(o).read_text() for o, _ in outputs], [Path(e).read_text() for _, e in outputs]


def run_failed(code: int, stderr: str) -> LocalRunError:
    """The error of a run whose launcher exited with ``code``: the ranks' own one-line errors
    (``autopart: ...``) where they wrote any, else the end of what they wrote."""
    errors = [line for line in stderr.splitlines() if line.startswith("autopart:")]
    tail = "\n".join(errors) if errors else stderr[-3000:]
    return LocalRunError(f"the distributed run failed (exit {code}):\n{tail}")
