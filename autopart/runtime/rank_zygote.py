"""Start the ranks of a run on this host by forking one process that has imported torch already.

Every rank of a generated program spends seconds of CPU importing torch, autopart's runtime and
(at its first optimizer step) ``torch._dynamo``, and torchrun's agent imports torch once more
before it starts them: on a small machine, as long as a short run's steps
(docs/cli.md has the figures). The runs a command makes here on the CPU (a pipeline's profile, a
search's finalists, ``autopart verify``; `autopart.tools.local_run`) start their ranks from this
process instead: it pays for those imports once and forks each rank from itself. A forked rank
is a real process with its own gloo rank, the whole ``os.environ`` its request gives it (the
variables torchrun gives its workers for their rank and rendezvous among them; what was read of
the environment at import, ``sys.path`` from PYTHONPATH say, is this process's), and runs
``train.py`` as ``python train.py`` would (``runpy``, ``__name__ == "__main__"``, its folder
first on ``sys.path``; an ``argv`` of ``["-m", module, ...]`` as ``python -m module`` would).
Unlike torchrun's: rank 0 hosts the rendezvous store (there is no agent), and the ranks share
this process's hash seed. This process runs no torch op, so no thread pool is inherited.

It ends with its parent: at the end of its stdin, or within a second of the parent's end while
idle, at once during a launch (its ranks are killed, and end with it however it ends).

Protocol, one JSON object per line: a request on stdin ``{"argv": [...], "envs": [{...}, ...],
"outputs": [[stdout_path, stderr_path], ...], "timeout": seconds, "cwd": folder}`` starts one
rank per entry of ``envs`` (in ``cwd``, where given); the answer on stdout is ``{"codes": [...],
"timed_out": bool, "failed": rank}`` once every rank has ended (``failed``: the first rank that
ended with a nonzero code, or null). When a rank fails the others are killed at once (torchrun
does the same), so a failure never waits for the survivors' collective timeouts; at the timeout
all are killed.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable

from autopart.ir.forked import end_with_parent

__all__ = ["launch", "main"]


def main(before: Callable[[], None] | None = None) -> None:
    """``python -m autopart.runtime.rank_zygote PID``: serve the process PID until it ends or
    closes this one's stdin. ``before``: what each rank does just before it runs its program (a
    test's instrumentation)."""
    parent = int(sys.argv[1])
    answers = os.fdopen(os.dup(1), "w")  # the answers' own copy: a stray print goes to stderr
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C ends this, through the parent
    import torch  # noqa: F401  (imported here once, for every rank)
    import torch._dynamo  # noqa: F401  (torch.optim imports it at the first step)
    import torch.distributed  # noqa: F401

    import autopart.runtime.train  # noqa: F401

    gc.freeze()  # what every rank shares stays shared: a rank's collections do not copy its pages
    for line in _requests(parent):
        answer = launch(json.loads(line), parent, before, answers.fileno())
        if os.getppid() != parent:
            break  # nobody to answer
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def _requests(parent: int):
    """The lines of stdin, until it ends or ``parent`` does: a process the parent forked may hold
    the pipe open after the parent is gone, so its end is not enough."""
    pending = b""
    while os.getppid() == parent:
        if not select.select([0], [], [], 1.0)[0]:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            yield line.decode()


def launch(request: dict, parent: int, before: Callable[[], None] | None = None, private: int | None = None) -> dict:
    """Fork the ranks of ``request``, wait for them; the answer. All are killed where one fails,
    the time runs out or ``parent`` ends. ``private``: a descriptor of this process's that the
    ranks close."""
    children, zygote = {}, os.getpid()
    for rank in range(len(request["envs"])):
        pid = os.fork()
        if pid == 0:
            if private is not None:
                os.close(private)
            _run_rank(request, rank, zygote, before)
        try:
            os.setpgid(pid, pid)  # here too, so that the group exists whichever of the two runs first
        except OSError:
            pass  # the child got there first (or already ended)
        children[pid] = rank
    codes: list[int | None] = [None] * len(children)
    deadline = time.monotonic() + request["timeout"]
    timed_out, failed = False, None
    while any(code is None for code in codes):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid and pid not in children:
            continue  # not a rank (something an import started)
        if pid:
            codes[children[pid]] = os.waitstatus_to_exitcode(status)
            if failed is None and codes[children[pid]] != 0:
                failed = children[pid]
            continue
        timed_out = failed is None and time.monotonic() > deadline
        if failed is not None or timed_out or os.getppid() != parent:
            _kill(pid for pid, rank in children.items() if codes[rank] is None)
            while any(code is None for code in codes):
                pid, status = os.waitpid(-1, 0)
                if pid in children:
                    codes[children[pid]] = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.02)
    return {"codes": codes, "timed_out": timed_out, "failed": failed}


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)  # the rank and what it started
        except ProcessLookupError:  # it left its group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it ended meanwhile


def _run_rank(request: dict, rank: int, zygote: int, before: Callable[[], None] | None) -> None:
    """In the forked child: become rank ``rank`` of ``request`` and never return."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: killing the rank kills what it started too
        end_with_parent(zygote)
        for fd, path in zip((1, 2), request["outputs"][rank], strict=True):  # first: what fails is said there
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        if request.get("cwd") is not None:
            os.chdir(request["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as python starts
        os.environ.clear()  # the request's whole environment, not the zygote's with it
        os.environ.update(request["envs"][rank])
        argv = request["argv"]
        module = argv[1] if argv[0] == "-m" else None
        sys.argv = list(argv[1:] if module else argv)  # ``-m``: run_module puts the module's file first
        sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))  # as python has it
        if before is not None:
            before()
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
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


if __name__ == "__main__":
    main()
