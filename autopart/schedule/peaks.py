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

__all__ = ["peak_in_flight", "transient_in_flight"]


def peak_in_flight(kind: str, *, ranks: int, microbatches: int, chunks: int = 1) -> tuple[int, ...]:
    """Per stage (``ranks * chunks`` of them), the most microbatches whose activations it holds."""
    p, m = ranks, microbatches
    if kind == "gpipe":  # every forward before any backward
        return (m,) * p
    if kind in ("1f1b", "zb-h1"):  # p - 1 - r warm-up forwards, then one in, one out
        return tuple(min(p - r, m) for r in range(p))
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
    return (1,) * (ranks * chunks)
