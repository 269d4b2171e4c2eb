"""How many microbatches' activations each stage holds at its peak, without building the schedule.

A microbatch's activations live from its forward to its whole backward, or, where the backward
is split, to its weight half (W): the input half (I) keeps the autograd graph for W
(``retain_graph``, `autopart.runtime.backward`), and with it every tensor the forward saved.

The search asks this for every layout it scores, for pipelines of up to hundreds of ranks, where
building and simulating the action lists takes seconds. Each stage lives on one rank, so its
peak follows from that rank's order of forwards and backwards alone, which ``generators.py``
fixes: ``warmup`` forwards, then one forward and one backward at a time. The counts below
follow that order in closed form; ``tests/test_schedule_peaks.py`` checks them against the
simulated timelines.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["peak_in_flight", "rank_peaks", "transient_in_flight"]


def peak_in_flight(kind: str, *, ranks: int, microbatches: int, chunks: int = 1) -> tuple[int, ...]:
    """Per stage (``ranks * chunks`` of them), the most microbatches whose activations it holds."""
    p, m = ranks, microbatches
    if kind == "gpipe":  # every forward before any backward
        return (m,) * p
    if kind == "1f1b":  # p - 1 - r warm-up forwards, then one in, one out
        return tuple(min(p - r, m) for r in range(p))
    if kind == "zb-h1":  # as 1F1B's to its I, and rank r holds r weight halves back: p on every rank
        return (min(p, m),) * p
    if kind == "zbv":  # stage s of the V (down then up) is as far from the loss as stage p - 1 - s of 1F1B over 2p
        return tuple(min(2 * p - s, m) for s in range(2 * p))
    if kind != "interleaved":
        raise ValueError(f"unknown schedule {kind!r}")
    if m % p == 0:  # each chunk's peak is at one of its rank's moments, which 3p microbatches show
        moments = _interleaved_candidates(p, min(m, INTERLEAVED_SHOWN * p), chunks)
        return tuple(max(held[c] for held in moments[r]) for c in range(chunks) for r in range(p))
    return _interleaved_counted(p, m, chunks)


def _interleaved_counted(p: int, m: int, v: int) -> tuple[int, ...]:
    """``peak_in_flight`` of interleaved 1F1B, counted step by step."""
    total = m * v
    peaks = [0] * (p * v)
    steps = np.arange(total)
    for r in range(p):
        warmup = min((v - 1) * p + 2 * (p - 1 - r), total)
        # after step j (its forward, before its backward): forwards 0 .. warmup + j, backwards 0 .. j - 1
        forwards = np.minimum(warmup + steps + 1, total)
        for c in range(v):
            held = _units(forwards, c, p, v) - _units(steps, v - 1 - c, p, v)
            peak = int(held.max()) if total else 0
            peaks[c * p + r] = max(peak, int(_units(np.array([warmup]), c, p, v)[0]))
    return tuple(peaks)


INTERLEAVED_SHOWN = 3
"""Microbatches, in multiples of p, after which interleaved 1F1B's moments on a rank are all shown.
After its warm-up a rank's chunks hold counts that repeat every round (p microbatches through
each of its v chunks: ``_units`` grows by p a round). From 3p microbatches on a whole round runs
between the warm-up and the last forward, and the drain after it lets microbatches go in the same
order for any m that is a multiple of p (as interleaved's must be), so more microbatches show no
new moment; ``tests/test_in_flight.py`` holds the shortcut to the full count. The search asks
for thousands of microbatches, whose moments would take the full count seconds a layout."""

ZBV_WALKED_RANKS = 64
"""ZB-V's moments are read off its action lists, about 4p² actions in all: over more ranks than
this, a rank is bounded by its two chunks' own peaks at once (safe; no closed form yet)."""


def rank_peaks(kind: str, *, ranks: int, microbatches: int, chunks: int = 1) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, the moments that may be its activation peak: at each, per stage it holds (in
    stage order), the microbatches whose activations are live together.

    A rank holding several stages (interleaved chunks, zbv's V) does not reach every stage's own
    peak at once: interleaved 1F1B's first rank holds ``(v - 1)·p + 2(p - 1) + 1`` chunk-microbatches
    at its fullest (Narayanan et al.'s ``p·(1 + (p - 1)/(p·v))`` microbatches of its ``v`` chunks),
    while each of its chunks, at its own moment, holds up to ``2p``. Which moment is the fullest
    depends on what each stage holds per microbatch, so every moment that may hold the most
    bytes for some sizes is given (``_peak_candidates``); the rank's peak is the largest of their sums."""
    m, v = microbatches, chunks
    if kind == "interleaved":  # its states repeat every round: 3p microbatches show them all
        return _interleaved_candidates(ranks, min(m, INTERLEAVED_SHOWN * ranks), v)
    if kind == "zbv" and ranks > ZBV_WALKED_RANKS:  # each chunk at its own peak: more than the rank holds
        peaks = peak_in_flight(kind, ranks=ranks, microbatches=m, chunks=2)
        return tuple(((peaks[r], peaks[2 * ranks - 1 - r]),) for r in range(ranks))
    if kind == "zbv":  # past its warm-up ZB-V repeats one round of states, so 2p microbatches show them all
        return _walked(kind, ranks, min(m, 2 * ranks))
    return tuple(((count,),) for count in peak_in_flight(kind, ranks=ranks, microbatches=m, chunks=chunks))


@functools.lru_cache(maxsize=256)  # the search asks for many microbatch counts that show the same moments
def _interleaved_candidates(p: int, m: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``_peak_candidates`` of interleaved 1F1B's moments, read at the steps where they may turn
    only: a chunk's count moves by the same step from one moment to the next until a forward or
    a backward crosses from one chunk's round into another's, so on each rank at most a few
    steps per round of ``p`` can turn (``_turning_steps``), not the ``m·v`` it takes. Over
    hundreds of ranks this is what keeps the search's interleaved layouts cheap."""
    total = m * v
    warmup = np.minimum((v - 1) * p + 2 * (p - 1 - np.arange(p)), total)[:, None]  # per rank
    start = np.stack([_units(warmup, c, p, v) for c in range(v)], axis=2)  # before the rank's first steady forward
    steps = _turning_steps(warmup, p, total)
    here = _interleaved_after(warmup, steps, p, v, total)
    before = np.where((steps == 0)[..., None], start, _interleaved_after(warmup, np.maximum(steps - 1, 0), p, v, total))
    after = _interleaved_after(warmup, np.minimum(steps + 1, total - 1), p, v, total)
    turns = ((after - here) != (here - before)).any(axis=2) | (steps == total - 1)
    return tuple(_uncovered(np.concatenate([first, rows[keep]])) for first, rows, keep in zip(start, here, turns))


def _turning_steps(warmup: np.ndarray, p: int, total: int) -> np.ndarray:
    """Per rank, the steady steps ``j`` at which its counts may turn: where its forwards
    (``warmup + j + 1`` of them) or its backwards (``j``) reach a multiple of ``p`` (a chunk's
    round begins or ends), where its forwards run out, and the first and last step."""
    rounds = np.arange(total // p + 2) * p
    ranks = len(warmup)
    steps = np.concatenate([np.broadcast_to(rounds, (ranks, len(rounds))), rounds - warmup - 1, total - warmup - 1,
                            np.zeros((ranks, 1), dtype=int), np.full((ranks, 1), total - 1)], axis=1)
    return np.clip(steps, 0, max(total - 1, 0))


def _interleaved_after(warmup: np.ndarray, steps: np.ndarray, p: int, v: int, total: int) -> np.ndarray:
    """Per rank and step, its chunks' live microbatches after the step's forward (its backwards
    ``0 .. j - 1`` done): ranks x steps x chunks."""
    forwards = np.minimum(warmup + steps + 1, total)
    return np.stack([_units(forwards, c, p, v) - _units(steps, v - 1 - c, p, v) for c in range(v)], axis=2)


@functools.lru_cache(maxsize=256)
def _walked(kind: str, ranks: int, microbatches: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The moments of ``_peak_candidates`` read off the action lists themselves (a forward takes a
    microbatch in, its backward or weight-gradient half lets it go), for schedules with no closed form."""
    from autopart.ir.actions import Kind
    from autopart.schedule.generators import build_schedule, stage_placement

    placement = stage_placement(kind, ranks=ranks, chunks=2)
    found = []
    for rank, actions in sorted(build_schedule(kind, ranks=ranks, microbatches=microbatches, chunks=2).items()):
        mine = [s for s, owner in enumerate(placement) if owner == rank]
        live, rows = [0] * len(mine), []
        for action in actions:
            if action.kind is Kind.F:
                live[mine.index(action.stage)] += 1
                rows.append(list(live))
            elif action.kind in (Kind.B, Kind.W):
                live[mine.index(action.stage)] -= 1
        found.extend(_peak_candidates(np.array([rows or [live]])))
    return tuple(found)


def _peak_candidates(held: np.ndarray) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank of ``held`` (ranks x moments x stages, the moments in the order the rank reaches
    them), the moments that may be its peak, fullest first.

    Between two moments where its counts turn, a rank's counts move by the same step each time
    (one chunk's forwards against another's backwards, for up to p moments): every moment inside
    such a run is a weighted mean of the run's two ends, so it never holds more bytes than both
    (the bytes are a sum of counts times per-microbatch sizes). Of the moments at the turns,
    those that another equals or exceeds on every stage are dropped too."""
    steps = np.diff(held, axis=1)
    turns = np.ones(held.shape[:2], dtype=bool)
    turns[:, 1:-1] = (steps[:, 1:] != steps[:, :-1]).any(axis=2)
    return tuple(_uncovered(rows[keep]) for rows, keep in zip(held, turns))


def _uncovered(rows: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """The rows that no other row equals or exceeds everywhere, fullest first: the fullest row
    left is one (a row at least as large everywhere would be fuller); it and the rows it covers
    are taken away until none is left. In plain Python: a rank has a few dozen rows, where
    numpy's per-call cost would be most of the time, and the search asks for hundreds of ranks."""
    left = sorted(set(map(tuple, rows.tolist())), key=lambda row: (-sum(row), row))  # fullest first, then by row
    kept = []
    while left:
        top = left[0]
        kept.append(top)
        left = [row for row in left if not all(count <= most for count, most in zip(row, top))]
    return tuple(kept)


def _units(n: np.ndarray, chunk: int, p: int, v: int) -> np.ndarray:
    """How many of the first ``n`` forward (or backward) units of a rank belong to ``chunk``:
    units go in rounds of ``p`` microbatches per chunk, chunk after chunk."""
    full, rest = np.divmod(n, p * v)
    return full * p + np.clip(rest - chunk * p, 0, p)


def transient_in_flight(kind: str, *, ranks: int, microbatches: int, chunks: int = 1) -> tuple[int, ...]:
    """Per stage, the most microbatches whose recomputed activations live at once
    (``autopart.passes.recompute.transient_microbatches``): one, where a backward is whole; in zb-h1,
    from a microbatch's I to its W, which rank r holds back r backwards (``generators._zb_h1``)."""
    if kind == "zb-h1":
        return tuple(min(r + 1, microbatches) for r in range(ranks))
    if kind == "zbv":  # chunk 0 on rank r holds r weight halves back in the cool-down, chunk 1 on it p - 1 - r
        return tuple(min(s + 1, microbatches) if s < ranks else max(1, 2 * ranks - 1 - s) for s in range(2 * ranks))
    return (1,) * (ranks * chunks)
