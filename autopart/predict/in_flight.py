"""One count of the microbatches in flight: per stage, how many microbatches' activations it
holds at its peak, how many recomputed activations (and weight-gradient seeds) live at once, and per rank that holds several
stages, what they hold together at the moments that may be the rank's peak.

The closed forms of `autopart.schedule.peaks` give what simulating the schedule gives
(``tests/test_in_flight.py`` holds them to it) without building action lists, which for
pipelines of hundreds of ranks the search could not afford per layout.
"""

from __future__ import annotations

import functools

from autopart.schedule.generators import SPLIT_BACKWARD_KINDS
from autopart.schedule.peaks import peak_in_flight, rank_peaks, transient_in_flight

__all__ = ["in_flight", "rank_in_flight", "transient", "weight_pending"]


@functools.lru_cache(maxsize=4096)
def in_flight(kind: str, pp: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    """Per virtual stage, microbatches whose activations it holds at its peak."""
    return peak_in_flight(kind, ranks=pp, microbatches=microbatches, chunks=chunks)


@functools.lru_cache(maxsize=4096)
def transient(kind: str, pp: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    """Per virtual stage, microbatches whose recomputed activations live at once."""
    return transient_in_flight(kind, ranks=pp, microbatches=microbatches, chunks=chunks)


def weight_pending(kind: str, pp: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    """Per virtual stage, microbatches whose weight-gradient seeds (`autopart.passes.weight_seeds`)
    live at once: under a split backward those between the stage's I and its W, as many as its
    recompute rebuilds at once (``transient``: both live from I to W); none on the first stage,
    whose I keeps its whole graph instead, and none where the backward is whole."""
    if kind not in SPLIT_BACKWARD_KINDS:
        return (0,) * (pp * chunks)
    return (0, *transient(kind, pp, microbatches, chunks)[1:])


@functools.lru_cache(maxsize=1024)
def rank_in_flight(kind: str, pp: int, microbatches: int, chunks: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, per moment that may be its peak, per stage it holds (in stage order): the
    microbatches whose activations are live together (`autopart.schedule.peaks.rank_peaks`)."""
    return rank_peaks(kind, ranks=pp, microbatches=microbatches, chunks=chunks)
