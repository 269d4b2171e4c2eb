"""ZB-V in the search: which layouts can run it, and its pipeline's step in closed form.

The search scores thousands of layouts, so it estimates each step without building the action
lists (the finalists are simulated on the real lists, ``autopart.solve.simulated``). ZB-V
(``autopart.schedule.vshape``) places two chunks per rank in a V, so in the steady state each rank
runs both of its chunks' forward, input-gradient and weight-gradient halves per microbatch: the
busiest rank's pair of chunks sets the pace. Its warm-up and cool-down leave a gap per hop that
the weight halves fill, except what they cannot cover: per hop, the larger of a chunk's forward
and twice its input-gradient half beyond its weight half. With F = I = W this is one forward per
hop, where 1F1B over the same ranks loses a forward and a backward of a whole stage per hop.
``tests/test_search.py`` checks the estimate against the simulated lists.
"""

from __future__ import annotations

__all__ = ["zbv_fits", "zbv_pipeline_s"]


def zbv_fits(pp: int, microbatches: int, blocks: int, chunks: tuple[int, ...] | None) -> bool:
    """Whether a layout of ``pp`` ranks can run ZB-V: two chunks per rank (``chunks`` pinned
    allows it), a block for each of the 2·pp stages, and the 2·pp − 1 microbatches its V needs."""
    return (chunks is None or 2 in chunks) and 2 * pp <= blocks and microbatches >= 2 * pp - 1


def zbv_pipeline_s(times: tuple[float, ...], weight_s: tuple[float, ...], p: int, m: int) -> float:
    """The pipeline of one step: ``times`` per stage (forward plus whole backward, V order: rank
    r holds stages r and 2p − 1 − r), ``weight_s`` its weight-gradient half. As the estimates of the
    other schedules, a forward is a third of a stage's time."""
    busiest = max(times[r] + times[2 * p - 1 - r] for r in range(p))
    gap = max(max(t / 3, 2 * (2 * t / 3 - w) - 2 * w) for t, w in zip(times, weight_s, strict=True))
    return m * busiest + (p - 1) * gap
