"""Work done by a forked copy of this process while this one goes on.

A compile forks for work that needs what it has built and gives back little: the search's
layouts scored ahead of their turn (`autopart.solve.scoring_pool`), a large plan's schedule
validated while its figures are predicted (`autopart.schedule.stored`), its report drawn while
the stage programs are written (`autopart.codegen.report`). A fork shares the parent's objects
(chain costs, schedules of a million actions) without copying or pickling them. It lives at the
bottom of the package because those three folders all use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator

from autopart.ir import errors
from autopart.ir.errors import AutopartError

__all__ = ["Forked", "ctrl_c_held", "end_with_parent", "may_fork", "quiet_child"]

_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends (Linux)


def may_fork() -> bool:
    """Whether this process may hand work to forked copies of itself: on Linux, where ``fork``
    is the platform's (a copy started afresh elsewhere would have none of what this one built),
    and not in a daemon process, which may not start children."""
    return sys.platform.startswith("linux") and not multiprocessing.current_process().daemon


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Ctrl-C held off in this thread while it forks children: each starts with it held (it
    inherits the mask) until `quiet_child` has it ignored; a child stopped half-started could
    hang this process's exit."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def quiet_child(parent: int) -> None:
    """What a forked child does first. A thread of the parent (the progress bar's) may have held
    stderr's lock as it forked: the child writes to /dev/null. Ctrl-C is the parent's, which ends
    its children: the child ignores it. It ends with its parent however that ends (SIGKILL
    included), and at once where the parent ended before it got here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # held as it was forked (`ctrl_c_held`)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the child's for its life
    end_with_parent(parent)


def end_with_parent(parent: int) -> None:
    """This process ends with its parent (``parent``, its pid) however that ends, SIGKILL
    included, and at once where the parent ended before it got here (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


class Forked:
    """``work()`` begun in a forked process (in this one, at once, with ``fork`` False or where
    `may_fork` says no); `wait` raises what went wrong in it, `stop` ends it.

    What went wrong comes back as text through a pipe, nothing unpickled: an `AutopartError` as
    the same class with its one line (the user's input was at fault, in the child as it would
    have been here); anything else as a RuntimeError that names ``what`` and carries the child's
    traceback. Only the process that began it may wait for it (``owner``)."""

    def __init__(self, work: Callable[[], object], *, what: str, fork: bool = True):
        self.what = what
        self.owner = os.getpid()
        self._process = None
        if not fork or not may_fork():
            work()
            return
        context = multiprocessing.get_context("fork")
        self._reading, writing = context.Pipe(duplex=False)

        def child() -> None:
            quiet_child(self.owner)
            try:
                work()
                answer = {}
            except AutopartError as exc:
                answer = {"error": type(exc).__name__, "message": str(exc)}
            except BaseException:
                answer = {"traceback": traceback.format_exc()}
            writing.send_bytes(json.dumps(answer).encode())
            os._exit(0)  # nothing of the parent's to flush or tear down

        with ctrl_c_held():
            self._process = context.Process(target=child, daemon=True)
            self._process.start()
        writing.close()  # the child's end alone stays open: its death reads as the end of the pipe

    def wait(self) -> None:
        """Once it has ended: nothing where it went well, else its error (see the class)."""
        if self._process is None:
            return
        try:
            answer = json.loads(self._reading.recv_bytes())
        except (EOFError, OSError):  # it died before it could say why, or while it did (killed, out of memory)
            answer = {}
        except BaseException:  # Ctrl-C while waiting: it ends with the wait
            self.stop()
            raise
        self._process.join()
        self._reading.close()
        code, self._process = self._process.exitcode, None
        if "error" in answer:
            kind = getattr(errors, answer["error"], None)
            raise (kind if isinstance(kind, type) and issubclass(kind, AutopartError) else AutopartError)(answer["message"])
        if "traceback" in answer:
            raise RuntimeError(f"{self.what} failed:\n{answer['traceback']}")
        if code != 0:
            raise RuntimeError(f"{self.what} failed: its process ended with code {code}")

    def stop(self) -> None:
        """End it now (before what it writes in is removed); nothing is raised."""
        if self._process is not None:
            self._process.terminate()
            self._process.join()
            self._reading.close()
            self._process = None
