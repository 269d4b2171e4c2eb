"""Run a compile's programs on this machine: loopback, a timeout; gloo on the CPU, or NCCL on
this machine's GPUs when the plan was compiled for a GPU and there is one per rank.

`autopart verify`, a pipeline's profile and a search's finalists all launch what the generated
``train.py`` runs here; this is the one place that knows how. On the GPUs the ranks start under
torchrun, as a user starts them. On the CPU they are forked from a process of this command that
has imported torch once (`autopart.runtime.rank_zygote`, which says how a forked rank differs
from torchrun's): torchrun's agent and every rank would import it again, seconds of a small
machine per launch, and a search's finalists launch a dozen times. ``forked=False`` takes
torchrun on the CPU too.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from autopart.ir.plan import Plan

__all__ = ["Launched", "LocalRunError", "RankZygote", "free_port", "run_failed", "run_forked", "run_here",
           "run_locally", "runs_on_gpus"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the generated train.py imports autopart


class LocalRunError(RuntimeError):
    """The programs failed or did not finish; the message holds the end of their log."""


def free_port() -> int:
    """A loopback port that no process holds now, for a rendezvous to listen on a moment later.
    Chosen at random below the kernel's ephemeral range: a port the kernel hands out (a bind to
    port 0) is free only until it hands it out again, to any other process's connection or
    listener (gloo's pairs in a run beside this one took it: EADDRINUSE), where below the range
    only a process that names the port itself can take it."""
    lowest_ephemeral = _ephemeral_range()[0]
    chooser = random.SystemRandom()  # not the seeded module generator: two runs seeded alike pick alike
    for _ in range(100) if lowest_ephemeral > _LOWEST_PORT + 1000 else ():
        port = chooser.randrange(_LOWEST_PORT, lowest_ephemeral)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_LOWEST_PORT = 10_000
"""Below it lie the ports services are registered at; free_port stays above them."""


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to a bind to port 0 (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def runs_on_gpus(plan: Plan) -> bool:
    """Whether the plan's programs run on this machine's GPUs: it was compiled for a GPU (its
    cost model's device is not the CPU) and each of its ranks can have a GPU of its own here."""
    device = plan.provenance.cost_model.rpartition(":")[2]
    return device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() >= plan.world_size


def run_locally(
    out_dir: Path, ranks: int, train_args: list[str], *, timeout_s: float, cwd: Path, gpus: bool = False,
    forked: bool = True,
) -> None:
    """What ``out_dir/train.py train_args`` runs (`autopart.runtime.__main__`, not the file, which
    the compile does not check) on ``ranks`` ranks of this host, one GPU per rank with
    ``gpus``, else on the CPU (the GPUs hidden) with one thread per rank; raises `LocalRunError`
    when it fails or outlasts ``timeout_s``. On the CPU the ranks are forked from this process's
    rank zygote, or with ``forked`` False started by torchrun; on the GPUs, always by torchrun."""
    argv = ["-m", "autopart.runtime", str(out_dir), *train_args, "--timeout", str(min(timeout_s, 300))]
    if gpus or not forked:
        _torchrun(argv, ranks, _environment(gpus), timeout_s=timeout_s, cwd=cwd)
    else:
        run_here(argv, ranks, timeout_s=timeout_s, cwd=cwd)


def run_here(argv: list[str], ranks: int, *, timeout_s: float, cwd: Path | None = None) -> None:
    """The program ``argv`` (a script, or ``-m`` and a module, and their arguments) on ``ranks``
    ranks of this host's CPU, forked from this process's rank zygote with the variables torchrun
    gives its workers (one thread each, the GPUs hidden); raises `LocalRunError` when it fails or
    outlasts ``timeout_s``."""
    launched = run_forked(_ZYGOTE, argv, ranks, _environment(), timeout_s=timeout_s, cwd=cwd)
    if launched.timed_out:
        raise _timed_out(timeout_s)
    if launched.failed_rank is not None:
        cause = _cause_rank(launched)
        raise run_failed(launched.codes[cause], "".join(launched.stderrs), failed=launched.stderrs[cause])


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker", "Broken pipe")
"""What a rank says when a peer died under it (gloo): the symptom, not the cause."""


def _cause_rank(launched: Launched) -> int:
    """Of the ranks that ended with a code of their own, the one that says why: the first to end
    may be a peer that found the failed rank's connection gone, where the failed rank ended an
    instant before the launcher looked (``launched.failed_rank`` is the first it saw)."""
    ended = [launched.failed_rank, *(r for r, code in enumerate(launched.codes)
                                     if code not in (0, -9) and r != launched.failed_rank)]
    return next((r for r in ended if not any(s in launched.stderrs[r] for s in _PEER_LOST)), launched.failed_rank)


def _environment(gpus: bool = False) -> dict[str, str]:
    """This process's environment for ranks here: on the CPU the GPUs hidden and one thread per
    rank, as torchrun starts them."""
    env = dict(os.environ) if gpus else dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return _with_package(env)


def _with_package(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this package first on PYTHONPATH: the generated train.py imports autopart."""
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p))


def _torchrun(argv: list[str], ranks: int, env: dict[str, str], *, timeout_s: float, cwd: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", *argv]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=cwd) as process:  # fmt: skip
        try:
            _, stderr = process.communicate(timeout=timeout_s)
        except BaseException as exc:
            _stop_torchrun(process)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise _timed_out(timeout_s) from None
            raise
    if process.returncode != 0:
        raise run_failed(process.returncode, stderr)


def _stop_torchrun(process: subprocess.Popen) -> None:
    """torchrun passes SIGTERM on to its workers, which it starts in sessions of their own and
    gives 30 s to end (killed outright, it would leave them running); then SIGKILL. Its pipes are
    closed, not read to their end: a worker that outlived it would hold them open."""
    process.terminate()
    try:
        process.wait(timeout=45)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for pipe in (process.stdout, process.stderr):
        with contextlib.suppress(OSError):
            pipe.close()


def _timed_out(timeout_s: float) -> LocalRunError:
    return LocalRunError(f"the distributed run did not finish within {timeout_s:.0f} s")


@dataclass(frozen=True, kw_only=True)
class Launched:
    """How the ranks of one forked launch ended."""

    codes: tuple[int, ...]  # per rank; a rank killed because a peer failed or the time ran out: -9
    timed_out: bool
    failed_rank: int | None  # the first rank that ended with a nonzero code of its own
    stdouts: tuple[str, ...]
    stderrs: tuple[str, ...]


class RankZygote:
    """An `autopart.runtime.rank_zygote` process (``command``, with this process's pid added),
    started at its first launch and again after one that did not end cleanly: it died, or its
    answer was not read (Ctrl-C, say), in which case it is killed and its ranks end with it. In
    a session of its own: the terminal's Ctrl-C is this process's, which ends it."""

    def __init__(self, command: list[str] | None = None, env: dict[str, str] | None = None):
        self.command = command or [sys.executable, "-m", "autopart.runtime.rank_zygote"]
        self.env = env
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()  # one launch at a time: the answers come back in order
        atexit.register(self.close)

    def launch(self, request: dict) -> dict:
        """Its answer to ``request`` (the protocol is `autopart.runtime.rank_zygote`'s)."""
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                env = _environment() if self.env is None else _with_package(self.env)
                # started in the package's folder: the caller's would come first on its sys.path
                self.process = subprocess.Popen([*self.command, str(os.getpid())], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, text=True, env=env, cwd=_PACKAGE_ROOT,
                                                start_new_session=True)  # fmt: skip
            process = self.process
            try:
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
                answer = process.stdout.readline()
                if not answer:
                    raise LocalRunError(f"the process that starts the ranks ended (exit {process.wait()})")
                return json.loads(answer)
            except BaseException as exc:
                self._end()
                if isinstance(exc, (OSError, ValueError)):
                    raise LocalRunError(f"the process that starts the ranks failed: {exc}") from None
                raise

    def _end(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            for pipe in (self.process.stdin, self.process.stdout):
                with contextlib.suppress(OSError):  # a request left in the buffer of a broken pipe
                    pipe.close()

    def close(self) -> None:
        """Ends it (it holds nothing to finish: killed, its ranks end with it); a launch in
        another thread then fails."""
        if self.process is not None:
            self.process.kill()
        with self.lock:
            self._end()


_ZYGOTE = RankZygote()  # no process until this compile's first run on the CPU


def run_forked(zygote: RankZygote, argv: list[str], ranks: int, env: dict[str, str], *, timeout_s: float,
               cwd: Path | None = None, extra: dict[str, str] | None = None) -> Launched:
    """``ranks`` ranks of the program ``argv`` forked by ``zygote`` on loopback, each with the
    environment ``env``, then the variables torchrun gives its workers for their rank and
    rendezvous, then ``extra``; in ``cwd``, or in the zygote's folder (the package's)."""
    port = free_port()
    envs = [{**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
             "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "ROLE_WORLD_SIZE": str(ranks),
             "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", **(extra or {})}
            for rank in range(ranks)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="autopart-ranks-") as folder:
        outputs = [[f"{folder}/{rank}.out", f"{folder}/{rank}.err"] for rank in range(ranks)]
        answer = zygote.launch({"argv": argv, "envs": envs, "outputs": outputs, "timeout": timeout_s,
                                "cwd": None if cwd is None else str(cwd)})
        return Launched(codes=tuple(answer["codes"]), timed_out=answer["timed_out"], failed_rank=answer["failed"],
                        stdouts=tuple(_text(o) for o, _ in outputs), stderrs=tuple(_text(e) for _, e in outputs))


def _text(path: str) -> str:
    """What a rank wrote there; nothing where it failed before it could open the file."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return ""


def run_failed(code: int, stderr: str, *, failed: str = "") -> LocalRunError:
    """The error of a run whose launcher exited with ``code``: the ranks' own one-line errors
    (``autopart: ...``) where they wrote any, else the end of what they wrote. ``failed``: what
    the rank that failed first wrote, which says the cause where the others' say only its
    symptom (a peer that closed its connection): its own errors, else the end of its traceback."""
    def errors(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("autopart:")]

    own = errors(failed) or failed.strip().splitlines()[-12:]
    lines = own or errors(stderr) or stderr[-3000:].splitlines()
    lines = [line for line in lines if line.strip()]
    cause = lines.pop().strip() if lines else ""  # on the first line, and not again below it
    return LocalRunError("\n".join([f"the distributed run failed (exit {code}): {cause}", *lines]))
