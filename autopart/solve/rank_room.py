"""A rank's memory when it holds several stages (interleaved chunks, zbv's V), for the search's
cutters (`autopart.solve.bottleneck`, `autopart.solve.refine`).

Its stages do not hold their own peaks at once: at each moment that may be the rank's peak
(`autopart.predict.in_flight.rank_in_flight`) each stage holds some microbatches, and the rank
holds its stages' parameters, what they keep once (recomputed activations) and, per moment, the
sum over its stages of microbatches times bytes per microbatch; its peak is the largest moment.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["RankRoom", "fastest_fitting", "rank_bytes", "stages_by_rank"]

Moments = tuple[tuple[int, ...], ...]  # per moment, per stage of the rank (in stage order), microbatches held


def rank_bytes(parts: Sequence[tuple[int, int, int]], moments: Moments) -> int:
    """The peak of a rank whose stages (in stage order) hold ``(parameter bytes, bytes per
    microbatch in flight, bytes held once)`` each."""
    fixed = sum(parameters + once for parameters, _, once in parts)
    return fixed + max(sum(count * per for count, (_, per, _) in zip(held, parts)) for held in moments)


def fastest_fitting(options: Sequence[Sequence[tuple]], moments: Moments | None, budget: int
                    ) -> tuple[float, tuple, int] | None:
    """Among every choice of one option per stage of a rank (``options[i]``: stage i's, each
    ``(mode, time, weight time, memory, parts)`` as `autopart.solve.refine` lists them), the
    first in `itertools.product`'s order of least summed time whose rank memory (the summed
    memories, or at ``moments`` `rank_bytes` of the parts) is within ``budget``: (time, the
    choice, its memory); None when none fits. All choices at once in arrays: an interleaved
    rank of six chunks in three recompute modes has 729, and the cutter asks for thousands of
    ranks."""
    times = np.zeros(())
    memory = np.zeros((), dtype=np.int64)
    held = np.zeros((1,) if moments is None else (len(moments),), dtype=np.int64)  # per moment, bytes in flight
    counts = None if moments is None else np.array(moments, dtype=np.int64).reshape(len(moments), -1)
    for i, stage in enumerate(options):
        times = times[..., None] + np.array([option[1] for option in stage])
        if counts is None:
            memory = memory[..., None] + np.array([option[3] for option in stage], dtype=np.int64)
        else:
            memory = memory[..., None] + np.array([option[4][0] + option[4][2] for option in stage], dtype=np.int64)
            per = np.array([option[4][1] for option in stage], dtype=np.int64)
            held = held[..., None, :] + per[:, None] * counts[:, i]
    total = memory if counts is None else memory + held.max(axis=-1)
    fits = total <= budget
    if not fits.any():
        return None
    best = int(np.argmin(np.where(fits, times, np.inf)))  # the first of the least, as a scan in product order
    index = np.unravel_index(best, times.shape)
    return float(times[index]), tuple(stage[k] for stage, k in zip(options, index)), int(total[index])


def stages_by_rank(stage_rank: Sequence[int]) -> list[list[int]]:
    """Per rank, the stages it holds, in stage order."""
    mine: list[list[int]] = [[] for _ in range(max(stage_rank) + 1)]
    for s, r in enumerate(stage_rank):
        mine[r].append(s)
    return mine


class RankRoom:
    """The ranks' memory as a cutter fills stages one after another, first to last: a stage fits
    where its rank, with it, stays within ``room_bytes`` less ``reserve_bytes`` for each of the
    rank's stages still to come (what one of them holds at the least)."""

    def __init__(self, *, stage_rank: tuple[int, ...], moments: Sequence[Moments], room_bytes: int, reserve_bytes: int):
        mine = stages_by_rank(stage_rank)
        ranks = len(mine)
        self.stage_rank = stage_rank
        self.index = [0] * len(stage_rank)  # each stage's place among its rank's
        for stages in mine:
            for i, s in enumerate(stages):
                self.index[s] = i
        self.later = [len(mine[r]) - 1 - self.index[s] for s, r in enumerate(stage_rank)]
        # per stage, the microbatches it holds at each of its rank's moments: plain lists, as a
        # rank has a few moments (`autopart.schedule.peaks`) and the cutter asks millions of times
        self.counts = [[held[self.index[s]] for held in moments[r]] for s, r in enumerate(stage_rank)]
        self.sizes = [len(moments[r]) for r in range(ranks)]
        self.room, self.reserve = room_bytes, reserve_bytes
        self.reset()

    def reset(self) -> None:
        self.fixed = [0] * len(self.sizes)
        self.held = [[0] * size for size in self.sizes]  # per rank, per moment, bytes in flight so far

    def fits(self, s: int, parameters: int, per_microbatch: int, once: int) -> bool:
        r = self.stage_rank[s]
        peak = 0  # a plain loop: a generator under max() costs more than the few moments it reads
        for held, count in zip(self.held[r], self.counts[s]):
            if held + count * per_microbatch > peak:
                peak = held + count * per_microbatch
        return self.fixed[r] + parameters + once + peak + self.later[s] * self.reserve <= self.room

    def take(self, s: int, parameters: int, per_microbatch: int, once: int) -> None:
        r = self.stage_rank[s]
        self.fixed[r] += parameters + once
        self.held[r] = [held + count * per_microbatch for held, count in zip(self.held[r], self.counts[s])]
