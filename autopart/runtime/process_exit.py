"""Ending a process that finished its work short of the interpreter's teardown, and the lines a
rank says on stderr on its way, each in one write."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

__all__ = ["leave", "say"]


def say(line: str) -> None:
    """``line`` on stderr in one write: the ranks of a node share its pipe, and print's two writes
    (the text, then its newline) of two ranks saying a line at once ran into one line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def leave(code: int = 0) -> NoReturn:
    """End the process as Python's own exit would, with ``code``, short of the interpreter's
    teardown, which frees every object one by one and runs C++ destructors: a trained rank's
    torch gloo teardown can abort there after every process group is destroyed ("terminate
    called without an active exception", SIGABRT, rarely and more often under load: torchrun
    then reports a job that finished as failed), and a large compile's millions of objects take
    seconds to free when nothing needs them. What a normal exit does first is done here, in its
    order: threading's own exit hooks (which stop idle executor workers) and the non-daemon
    threads joined, the exit handlers run (a model file's too; `weakref.finalize`'s, which remove
    temporary folders), the streams flushed."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a reader gone (``autopart explain | head``): 120, as Python's own exit says it
            code = 120
    os._exit(code)
