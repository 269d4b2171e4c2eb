"""Layouts scored ahead of their turn in worker processes, their answers taken in turn.

A search of a long model on thousands of GPUs cuts hundreds of layouts one after another
(``autopart.solve.search``), each in tens of milliseconds, nearly all of its time; they are
independent but for what the search has found before each: the last finalist, under which a
layout is refined or not, and which ends the walk. Scoring them ahead in worker processes,
each under the last finalist as it stood when it was sent (never below the one of its turn,
since finalists only improve), and keeping what the turn's own finalist would change
(`autopart.solve.search.Speculation`: the cuts both unrefined and refined where it refined),
gives exactly the answers of one process, in the same order, on any number of workers.

The workers are forked, so they share the chain costs the search has built; the search asks a
layout's costs (its bound) before it sends it, and a layout whose costs came after the workers
were forked goes to new workers forked after them (costing a chain captures and solves, which a
forked child must not do). A forked child may inherit a lock that a thread of the parent held
(the progress bar's, on stderr): the workers write to /dev/null, and ignore Ctrl-C, which the
parent answers by stopping them. Only where ``fork`` is the platform's (Linux) and more than one
core is the process's; ``$AUTOPART_SEARCH_WORKERS`` sets how many (0: score in this process).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from autopart.ir.errors import ConfigError
from autopart.ir.forked import ctrl_c_held, may_fork, quiet_child
from cost_models.calibration import usable_cores

__all__ = ["WORKERS_ENV", "LayoutScoring", "search_workers"]

WORKERS_ENV = "AUTOPART_SEARCH_WORKERS"
PARALLEL_FROM = 256
"""Layouts in a search from which it scores in worker processes: a smaller one takes a second or
two, less than forking and feeding the workers would save."""
MOST_WORKERS = 8
"""Workers at most: the answers come in turn, so more mostly score layouts the walk never reaches."""

Score = Callable[[Any, float], Any]  # (layout, last finalist's seconds) -> its answer
Finish = Callable[[Any], Any]  # a finalist -> its figure

_scoring: Score | None = None  # in a worker: its parent's scoring, set as it starts
_finishing: Finish | None = None


def search_workers(layouts: int) -> int:
    """Workers for a search of ``layouts`` layouts: ``$AUTOPART_SEARCH_WORKERS``, else one per
    usable core (at most `MOST_WORKERS`) from `PARALLEL_FROM` layouts on; 0 where fork is not the
    platform's, this process may not start children (a daemon), or one core is all there is.
    Raises ConfigError for a value that is not a count (``autopart compile`` asks before it captures)."""
    text = os.environ.get(WORKERS_ENV, "").strip()
    if text and not (text.isascii() and text.isdigit()):
        raise ConfigError(f"{WORKERS_ENV}={text!r} is not a number of processes; "
                          "set it to 0 (score in this process), 2, 4, ..., or unset it")
    if not may_fork():
        return 0
    if text:
        return int(text)
    cores = usable_cores()
    return min(cores, MOST_WORKERS) if cores > 1 and layouts >= PARALLEL_FROM else 0


class LayoutScoring:
    """``score(layout, last_finalist_s)`` for the layouts sent, ``ahead`` of their turn on
    ``workers`` forked processes, or at their turn in this one (``workers`` 0: `submit` scores at
    once, so the caller sends each layout at its turn). ``key(layout)``: the chain costs it reads;
    ``built``: the keys whose costs this process holds (read at each fork). A layout whose key was
    not built when the workers were forked goes to new ones. ``finish``: what `finished` asks of
    the finalists, in this process unless ``finish_on_workers`` (where it reads only built costs
    and changes nothing) and there are workers."""

    def __init__(self, score: Score, *, workers: int, key: Callable[[Any], Hashable], built: Iterable[Hashable] = (),
                 finish: Finish | None = None, finish_on_workers: bool = False):
        self.score, self.workers, self.key, self.built, self.finish = score, workers, key, built, finish
        self.finish_on_workers = finish_on_workers
        self.ahead = 2 * workers if workers else 1
        self._pool: ProcessPoolExecutor | None = None
        self._known: set[Hashable] = set()
        self._sent: list[Future] = []

    def submit(self, layout: Any, last_finalist_s: float) -> Future:
        """A future of the layout scored under this last finalist: now (no workers) or ahead."""
        if not self.workers:
            return self.here(layout, last_finalist_s)
        key = self.key(layout)
        if self._pool is not None and key in self._known:
            return self._track(self._pool.submit(_scored, layout, last_finalist_s))
        with ctrl_c_held():  # a new pool forks its workers at its first submit
            self._fork(key)
            return self._track(self._pool.submit(_scored, layout, last_finalist_s))

    def here(self, layout: Any, last_finalist_s: float) -> Future:
        """A future of the layout scored now, in this process: one whose turn has come, which
        sent to the workers would wait behind the layouts sent ahead of it."""
        done: Future = Future()
        done.set_result(self.score(layout, last_finalist_s))
        return done

    def _track(self, future: Future) -> Future:
        self._sent.append(future)
        return future

    def finished(self, finalists: list, meanwhile: Callable[[list], None] | None = None) -> list:
        """``finish`` of each finalist (their layouts sent before), on the workers where it may run
        there; ``meanwhile(finalists)`` runs in this process as they do (before, where they run here)."""
        if self._pool is None or not self.finish_on_workers:
            if meanwhile is not None:
                meanwhile(finalists)
            return [self.finish(item) for item in finalists]
        pending = [self._pool.submit(_finished, item) for item in finalists]
        if meanwhile is not None:
            meanwhile(finalists)
        return [future.result() for future in pending]

    def drop_ahead(self) -> None:
        """Drop what the workers were sent and have not begun (the walk ended before its turn)."""
        for future in self._sent:
            future.cancel()
        self._sent = []

    def close(self) -> None:
        """`drop_ahead`, and end the workers once they finish the rest (the current ones waited
        for; earlier ones end by themselves, or with this process)."""
        self.drop_ahead()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None

    def _fork(self, key: Hashable) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # its workers finish what they hold; their futures stay readable
        self._known = {*self.built, key}
        self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                         initializer=_start, initargs=(self.score, self.finish if self.finish_on_workers else None,
                                                                        os.getpid()))

    def __enter__(self) -> LayoutScoring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start(score: Score, finish: Finish | None, parent: int) -> None:
    """A worker's start: its parent's scoring (forked, not pickled), and the quiet of a forked
    child (`autopart.ir.forked.quiet_child`: no output, Ctrl-C left to the parent, its end with
    the parent's)."""
    global _scoring, _finishing
    _scoring, _finishing = score, finish
    quiet_child(parent)


def _scored(layout: Any, last_finalist_s: float) -> Any:
    assert _scoring is not None, "a scoring worker started without its parent's scoring"
    return _scoring(layout, last_finalist_s)


def _finished(finalist: Any) -> Any:
    assert _finishing is not None, "a scoring worker started without its parent's scoring of finalists"
    return _finishing(finalist)
