"""How many microbatches' activations each stage holds at its peak, without building the schedule.

The search asks this for every layout it scores, for pipelines of up to hundreds of ranks, where
building and simulating the action lists takes seconds. Each stage lives on one rank, so its
peak follows from that rank's order of forwards and backwards alone, which ``generators.py``
fixes: ``warmup`` forwards, then one forward and one backward at a time. The counts below
follow that order in closed form; ``tests/test_schedule_peaks.py`` checks them against the
simulated timelines.
"""

from __future__ import annotations

import numpy as np

__all__ = ["peak_in_flight", "rank_peaks", "transient_in_flight"]


def peak_in_flight(kind: str, *, ranks: int, microbatches: int, chunks: int = 1) -> tuple[int, ...]:
    """Per stage (``ranks * chunks`` of them), the most microbatches whose activations it holds."""
    p, m = ranks, microbatches
    if kind == "gpipe":  # every forward before any backward
        return (m,) * p
    if kind in ("1f1b", "zb-h1"):  # p - 1 - r warm-up forwards, then one in, one out
        return tuple(min(p - r, m) for r in range(p))
    if kind == "zbv":  # stage s of the V (down then up) is as far from the loss as stage p - 1 - s of 1F1B over 2p
        return tuple(min(2 * p - s, m) for s in range(2 * p))
    if kind != "interleaved":
        raise ValueError(f"unknown schedule {kind!r}")
    v = chunks
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
    depends on what each stage holds per microbatch, so every moment that no other moment
    equals or exceeds on every stage is given; the rank's peak is the largest of their sums."""
    m, v = microbatches, chunks
    if kind == "interleaved":
        return tuple(_pareto(_interleaved_held(r, ranks, m, v)) for r in range(ranks))
    if kind == "zbv" and ranks > ZBV_WALKED_RANKS:  # each chunk at its own peak: more than the rank holds
        peaks = peak_in_flight(kind, ranks=ranks, microbatches=m, chunks=2)
        return tuple(((peaks[r], peaks[2 * ranks - 1 - r]),) for r in range(ranks))
    if kind == "zbv":  # past its warm-up ZB-V repeats one round of states, so 2p microbatches show them all
        return _walked(kind, ranks, min(m, 2 * ranks))
    return tuple(((count,),) for count in peak_in_flight(kind, ranks=ranks, microbatches=m, chunks=chunks))


def _interleaved_held(r: int, p: int, m: int, v: int) -> np.ndarray:
    """Rank ``r``'s chunks' live microbatches after each of its forwards (rows; a column per chunk)."""
    total = m * v
    steps = np.arange(total)
    warmup = min((v - 1) * p + 2 * (p - 1 - r), total)
    forwards = np.minimum(warmup + steps + 1, total)
    after = np.stack([_units(forwards, c, p, v) - _units(steps, v - 1 - c, p, v) for c in range(v)], axis=1)
    start = np.array([[int(_units(np.array([warmup]), c, p, v)[0]) for c in range(v)]])
    return np.concatenate([start, after])


def _walked(kind: str, ranks: int, microbatches: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The moments of ``_pareto`` read off the action lists themselves (a forward takes a
    microbatch in, its backward or input-gradient half lets it go), for schedules with no closed form."""
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
            elif action.kind in (Kind.B, Kind.I):
                live[mine.index(action.stage)] -= 1
        found.append(_pareto(np.array(rows or [live])))
    return tuple(found)


def _pareto(held: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """The rows of ``held`` that no other row equals or exceeds everywhere, fullest first."""
    rows = np.array(sorted(set(map(tuple, held.tolist())), key=lambda row: (-sum(row), row)), dtype=np.int64)
    kept = []
    for start in range(0, len(rows), 256):  # rows x rows x stages booleans, a block of rows at a time
        block = rows[start:start + 256]
        covers = (rows[None, :, :] >= block[:, None, :]).all(axis=2)  # covers[i, j]: row j >= row i everywhere
        covers[np.arange(len(block)), np.arange(start, start + len(block))] = False
        kept.extend(block[~covers.any(axis=1)])
    return tuple(tuple(int(x) for x in row) for row in kept)


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
