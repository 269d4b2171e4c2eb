"""Start the ranks of a run on this host by forking one process that has imported torch already.

Every rank of a generated program spends seconds of CPU importing torch, autopart's runtime and
(at its first optimizer step) ``torch._dynamo``, and torchrun's agent imports torch once more
before it starts them: on a 2-core machine, about 8 s before the first step of a run that
lasts 8. The runs a compile makes here on the CPU (a pipeline's profile, a search's finalists,
``autopart verify``; `autopart.tools.local_run`) start their ranks from this process instead: it
pays for those imports once per compile and forks each rank from itself. A forked rank is a real
process with its own gloo rank and the environment torchrun gives its workers, and runs
``train.py`` as ``python train.py`` would (``runpy``, ``__name__ == "__main__"``, its folder first
on ``sys.path``). This process runs no torch op, so no thread pool is inherited; it ends with the
process that started it, and its ranks with it.

Protocol, one JSON object per line: a request on stdin ``{"argv": [...], "envs": [{...}, ...],
"outputs": [[stdout_path, stderr_path], ...], "timeout": seconds, "cwd": folder}`` starts one
rank per entry of ``envs`` (in ``cwd``, where given); the answer on stdout is ``{"codes": [...],
"timed_out": bool}`` once every rank has ended. When a rank fails the others are killed at once
(torchrun does the same), so a failure never waits for the survivors' collective timeouts; at the
timeout all are killed.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback
from collections.abc import Callable

import torch  # noqa: F401  (imported here once, for every rank)
import torch._dynamo  # noqa: F401  (torch.optim imports it at the first step)
import torch.distributed  # noqa: F401

import autopart.runtime.train  # noqa: F401
from autopart.ir.forked import end_with_parent

__all__ = ["launch", "main", "serve"]


def _run_rank(request: dict, rank: int, parent: int, before: Callable[[], None] | None) -> None:
    """In the forked child: become rank ``rank`` of ``request`` and never return."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: killing the rank kills what it started too
        end_with_parent(parent)
        if request.get("cwd") is not None:
            os.chdir(request["cwd"])
        for fd, path in zip((1, 2), request["outputs"][rank], strict=True):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as python starts (the zygote ignores it)
        os.environ.update(request["envs"][rank])
        argv = request["argv"]
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        if before is not None:
            before()
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("message"): python prints it and exits 1
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (reported as python would, then the exit code says it)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(request: dict, before: Callable[[], None] | None = None) -> dict:
    """Fork the ranks of ``request``, wait for them; the answer. ``before``: what each rank does
    just before it runs the program (a test's instrumentation)."""
    children, parent = {}, os.getpid()
    for rank in range(len(request["envs"])):
        pid = os.fork()
        if pid == 0:
            _run_rank(request, rank, parent, before)
        try:
            os.setpgid(pid, pid)  # here too, so that the group exists whichever of the two runs first
        except OSError:
            pass  # the child got there first (or already ended)
        children[pid] = rank
    codes: list[int | None] = [None] * len(children)
    deadline = time.monotonic() + request["timeout"]
    timed_out = failed = False
    while any(code is None for code in codes):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[children[pid]] = os.waitstatus_to_exitcode(status)
            failed = failed or codes[children[pid]] != 0
            continue
        timed_out = time.monotonic() > deadline
        if failed or timed_out:
            for other, rank in children.items():
                if codes[rank] is None:
                    os.killpg(other, signal.SIGKILL)
            while any(code is None for code in codes):
                pid, status = os.waitpid(-1, 0)
                codes[children[pid]] = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.02)
    return {"codes": codes, "timed_out": timed_out}


def serve(before: Callable[[], None] | None = None) -> None:
    """Answer the requests on stdin until it closes."""
    for line in sys.stdin:
        sys.stdout.write(json.dumps(launch(json.loads(line), before)) + "\n")
        sys.stdout.flush()


def main(before: Callable[[], None] | None = None) -> None:
    """``python -m autopart.runtime.rank_zygote PID``: serve the process PID, end with it."""
    end_with_parent(int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is the compile's, which ends this
    serve(before)


if __name__ == "__main__":
    main()
