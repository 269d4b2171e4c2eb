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
forked child must not do). Only where ``fork`` is the platform's (Linux) and more than one core is
the process's; ``$AUTOPART_SEARCH_WORKERS`` sets how many (0: score in this process).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Hashable
from typing import Any

from autopart.ir.errors import ConfigError
from cost_models.calibration import usable_cores

__all__ = ["WORKERS_ENV", "LayoutScoring", "search_workers"]

WORKERS_ENV = "AUTOPART_SEARCH_WORKERS"
PARALLEL_FROM = 256
"""Layouts in a search from which it scores in worker processes: a smaller one takes a second or
two, less than forking and feeding the workers would save."""
MOST_WORKERS = 8
"""Workers at most: the answers come in turn, so more mostly score layouts the walk never reaches."""

_score: Callable[[Any, float], Any] | None = None  # the forked workers' scoring, set before each fork
_finish: Callable[[Any], Any] | None = None


def search_workers(layouts: int) -> int:
    """Workers for a search of ``layouts`` layouts: ``$AUTOPART_SEARCH_WORKERS``, else one per
    usable core (at most `MOST_WORKERS`) from `PARALLEL_FROM` layouts on; 0 where fork is not the
    platform's or one core is all there is."""
    text = os.environ.get(WORKERS_ENV, "").strip()
    if text:
        if not text.isdigit():
            raise ConfigError(f"{WORKERS_ENV}={text!r} is not a number of processes; "
                              "set it to 0 (score in this process), 2, 4, ..., or unset it")
        return int(text) if sys.platform.startswith("linux") and not multiprocessing.current_process().daemon else 0
    if not sys.platform.startswith("linux") or layouts < PARALLEL_FROM or multiprocessing.current_process().daemon:
        return 0  # (a daemonic process, a worker of someone's pool, may not start processes of its own)
    cores = usable_cores()
    return min(cores, MOST_WORKERS) if cores > 1 else 0


class LayoutScoring:
    """``score(layout, last_finalist_s)`` for the layouts sent, ``ahead`` of their turn on
    ``workers`` forked processes, or at their turn in this one (``workers`` 0: `submit` scores at
    once, so the caller sends each layout at its turn). ``key(layout)``: the chain costs it reads;
    a key not seen when the workers were forked sends it to new workers."""

    def __init__(self, score: Callable[[Any, float], Any], *, workers: int, key: Callable[[Any], Hashable],
                 finish: Callable[[Any], Any] | None = None):
        self.score, self.workers, self.key, self.finish = score, workers, key, finish
        self.ahead = 2 * workers if workers else 1
        self._pool: Any = None
        self._known: set[Hashable] = set()
        self._retired: list[Any] = []  # earlier workers, finishing what they were sent

    def submit(self, layout: Any, last_finalist_s: float) -> Any:
        """A handle for `result`: the layout scored under this last finalist, now or ahead."""
        if not self.workers:
            return _Done(self.score(layout, last_finalist_s))
        key = self.key(layout)
        if self._pool is None or key not in self._known:
            self._fork(key)
        return self._pool.apply_async(_scored, (layout, last_finalist_s))

    def result(self, handle: Any) -> Any:
        return handle.get()

    def finished(self, scored: list) -> list:
        """``finish`` of each of ``scored`` (layouts sent before), on the workers where there are some."""
        if self._pool is None:
            return [self.finish(item) for item in scored]
        return self._pool.map(_finished, scored, chunksize=1)

    def close(self) -> None:
        """Stop every worker (what they score ahead is not needed)."""
        for pool in (*self._retired, self._pool):
            if pool is not None:
                pool.terminate()
                pool.join()
        self._pool, self._retired = None, []

    def _fork(self, key: Hashable) -> None:
        global _score, _finish
        if self._pool is not None:
            self._pool.close()  # its workers finish what they hold, and their answers stay readable
            self._retired.append(self._pool)
        self._known.add(key)
        _score, _finish = self.score, self.finish
        self._pool = multiprocessing.get_context("fork").Pool(self.workers)

    def __enter__(self) -> LayoutScoring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Done:
    """A handle whose layout was scored at once."""

    def __init__(self, value: Any):
        self.value = value

    def get(self) -> Any:
        return self.value


def _finished(scored: Any) -> Any:
    """In a worker: the finalists' scoring its parent set before forking it."""
    assert _finish is not None, "a scoring worker started without its parent's scoring of finalists"
    return _finish(scored)


def _scored(layout: Any, last_finalist_s: float) -> Any:
    """In a worker: the scoring its parent set before forking it."""
    assert _score is not None, "a scoring worker started without its parent's scoring"
    return _score(layout, last_finalist_s)
