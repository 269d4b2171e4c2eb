"""Starts the ranks of a test launch by forking one process that has imported torch already.

Every rank of a generated program spends ~5 s of CPU importing torch, autopart's runtime and
(at its first optimizer step) ``torch._dynamo`` before it trains a tiny model for a few
milliseconds; with ~70 launches of 2 to 8 ranks on 2 cores, that was most of the test suite.
This process pays for those imports once and forks each rank from itself. A forked rank is a
real process with its own gloo rank, its environment set as torchrun sets its workers', and runs
``train.py`` as ``python train.py`` would (``runpy``, ``__name__ == "__main__"``, its folder
first on ``sys.path``). It runs no torch op before it forks, so no thread pool is inherited.

Protocol, one JSON object per line: a request on stdin ``{"argv": [...], "envs": [{...}, ...],
"outputs": [[stdout_path, stderr_path], ...], "timeout": seconds, "cwd": folder}`` starts one
rank per entry of ``envs`` (in ``cwd``, where given); the answer on stdout is ``{"codes": [...], "timed_out": bool}`` once every rank has
ended. When a rank fails the others are killed at once (torchrun does the same), so a failure
never waits for the survivors' collective timeouts; at the timeout all are killed.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

import torch  # noqa: F401  (imported here once, for every rank)
import torch._dynamo  # noqa: F401  (torch.optim imports it at the first step)
import torch.distributed  # noqa: F401

import autopart.runtime.train  # noqa: F401


def _run_rank(argv: list[str], env: dict[str, str], stdout_path: str, stderr_path: str, cwd: str | None) -> None:
    """In the forked child: become one rank and never return."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: killing the rank kills what it started too
        if cwd is not None:
            os.chdir(cwd)
        for fd, path in ((1, stdout_path), (2, stderr_path)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.update(env)
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        if os.environ.get("AUTOPART_DEVICE_CHECK"):  # tests/device_checker.py's docstring says why
            from tests.device_checker import install

            install(os.environ["AUTOPART_DEVICE_CHECK"])
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


def _launch(request: dict) -> dict:
    children = {}
    for rank, (env, (stdout_path, stderr_path)) in enumerate(zip(request["envs"], request["outputs"], strict=True)):
        pid = os.fork()
        if pid == 0:
            _run_rank(request["argv"], env, stdout_path, stderr_path, request.get("cwd"))
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


def main() -> None:
    for line in sys.stdin:
        sys.stdout.write(json.dumps(_launch(json.loads(line))) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
