"""One count of the microbatches in flight: per stage, how many microbatches' activations it
holds at its peak, and how many recomputed activations live at once.

The closed forms of `autopart.schedule.peaks` give what simulating the schedule gives
(``tests/test_in_flight.py`` holds them to it) without building action lists, which for
pipelines of hundreds of ranks the search could not afford per layout.
"""

from __future__ import annotations

import functools

from autopart.schedule.peaks import peak_in_flight, transient_in_flight

__all__ = ["in_flight", "transient"]


@functools.lru_cache(maxsize=4096)
def in_flight(kind: str, pp: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    """Per virtual stage, microbatches whose activations it holds at its peak."""
    return peak_in_flight(kind, ranks=pp, microbatches=microbatches, chunks=chunks)


@functools.lru_cache(maxsize=4096)
def transient(kind: str, pp: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    """Per virtual stage, microbatches whose recomputed activations live at once."""
    return transient_in_flight(kind, ranks=pp, microbatches=microbatches, chunks=chunks)
