"""From the smallest slowest stage to the shortest step: the cuts judged by the step itself.

``cut_stages`` (``autopart.solve.bottleneck``) finds the cuts whose slowest stage is smallest.
The step that the search ranks layouts by has more in it: every stage's time once (the
pipeline's fill and drain), the schedule's own terms (zb-h1 fills its cool-down with the
smallest stage's weight gradients; an interleaved rank runs several stages, so what counts is
the slowest rank at each step of the schedule and the largest stage), and after the pipeline
the busiest rank's gradient all-reduce and optimizer step, which grow with the parameters it
holds. ``refine_cuts`` judges cuts by the step itself
(an ``objective`` given by the search) and

- where the chain has few cut sets (at most ``ENUMERATE_LIMIT``), tries every one of them;
- otherwise starts from the bisection's cuts and moves one cut at a time, by up to ``RADIUS``
  blocks either way, while that shortens the step: the cuts next to the stages that set a term
  of the step (the slowest stage or rank, the least weight-gradient work, the most parameters,
  a recompute), which are the only ones whose move can shorten it by more than a transfer.

For given cuts the recompute modes are exact: each rank takes the modes of its stages that make
its time smallest within its memory (a rank's time is what every schedule's step grows with).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from autopart.ir.recompute import RECOMPUTE_MODES
from autopart.solve.bottleneck import StageCut
from autopart.solve.chain_costs import ChainCosts, stage_figures
from autopart.solve.rank_room import fastest_fitting, stages_by_rank

__all__ = ["ENUMERATE_LIMIT", "RADIUS", "SHIFT_SPAN", "FAR_STAGES", "CutJudge", "refine_cuts"]

ENUMERATE_LIMIT = 400
"""Chains with at most this many cut sets are searched exhaustively."""
RADIUS = 4
"""Blocks a cut may move in one step of the local search."""

SHIFT_SPAN = 4
FAR_STAGES = 16
"""A move passes blocks across at most ``SHIFT_SPAN`` stages, unless there are at most
``FAR_STAGES`` stages (each stage it moves is evaluated again)."""

Objective = Callable[[StageCut, list[int]], float]
"""(cut, parameter bytes held per rank) -> the step's seconds."""


class CutJudge:
    """The figures and the step of any cut set of one layout, with the best modes per rank."""

    def __init__(self, costs: ChainCosts, *, in_flight: tuple[int, ...], stage_rank: tuple[int, ...],
                 transfer_s: tuple[float, ...], memory_limit_bytes: int, overhead_bytes: int,
                 modes: tuple[tuple[str, ...], ...], objective: Objective, transient: tuple[int, ...] | None = None,
                 rank_in_flight: tuple[tuple[tuple[int, ...], ...], ...] | None = None,
                 rank_extra: Callable[[tuple[tuple[int, int], ...]], int] | None = None):
        self.costs = costs
        self.rank_extra = rank_extra  # a rank's bytes beside its stages', of its spans (ZeRO-1's owners)
        self.moments = rank_in_flight  # a rank of several stages is held at its fullest moment (`rank_room`)
        self.stages = len(stage_rank)
        self.in_flight, self.stage_rank, self.transfer_s = in_flight, stage_rank, transfer_s
        self.returning_s = costs.gradient_transfer_s(transfer_s)  # the gradient a stage sends back over its first boundary
        self.transient = transient or (1,) * self.stages
        self.ranks = max(stage_rank) + 1
        self.rank_stages = [tuple(stages) for stages in stages_by_rank(stage_rank)]
        self.budget = memory_limit_bytes - overhead_bytes
        self.overhead_bytes = overhead_bytes
        self.modes = modes
        self.objective = objective
        self._stage: dict[tuple[int, int, int], list[tuple[str, float, float, int]]] = {}
        self._rank: dict[tuple, tuple | None] = {}
        self._owned = costs.prefix("owned_weight_bytes")
        self.judged = 0

    def _options(self, s: int, first: int, last: int) -> list[tuple[str, float, float, int, tuple[int, int, int]]]:
        """Per allowed mode of stage s on blocks first..last: (mode, time, weight time, memory, and
        memory's parts: `bottleneck.stage_figures`)."""
        key = (s, first, last)
        if key not in self._stage:
            options = []
            for mode in self.modes[s]:
                f = stage_figures(self.costs, first, last, mode=mode, in_flight=self.in_flight[s],
                                  transfer_in_s=self.returning_s[first - 1] if s > 0 else 0.0,
                                  transfer_out_s=self.transfer_s[last] if s < self.stages - 1 else 0.0,
                                  transient=self.transient[s])
                options.append((mode, f.time_s, f.weight_s, f.memory_bytes, f.parts))
            self._stage[key] = options
        return self._stage[key]

    def _rank_result(self, r: int, spans: tuple[tuple[int, int], ...]) -> tuple | None:
        """Rank r holding blocks ``spans`` (one span per stage): its stages' options in the modes
        with the smallest time sum that fit its memory, its memory, and its parameter bytes."""
        key = (r, spans)
        if key not in self._rank:
            per_stage = [self._options(s, a, b) for s, (a, b) in zip(self.rank_stages[r], spans)]
            extra = self.rank_extra(spans) if self.rank_extra is not None else 0
            budget, best = self.budget - extra, None
            if len(per_stage) == 1:
                for option in per_stage[0]:
                    if option[3] <= budget and (best is None or option[1] < best[0]):
                        best = (option[1], (option,), option[3])
            else:
                best = fastest_fitting(per_stage, None if self.moments is None else self.moments[r], budget)
            if best is None:
                self._rank[key] = None
            else:
                read, owned, nbytes = set(), set(), 0
                for a, b in spans:
                    stage_bytes, shared_read, shared_owned = self._weights_of(a, b)
                    nbytes += stage_bytes
                    read |= shared_read
                    owned |= shared_owned
                nbytes += sum(self.costs.parameter_bytes[p] for p in read - owned)
                self._rank[key] = (best[1], self.overhead_bytes + best[2] + extra, nbytes)
        return self._rank[key]

    def _weights_of(self, first: int, last: int) -> tuple[int, frozenset, frozenset]:
        """(bytes of the parameters first read in first..last, shared ones read there, shared ones first read there)."""
        shared = self.costs.shared_parameters
        read = frozenset(p for p, readers in shared.items() if any(first <= k <= last for k in readers))
        owned = frozenset(p for p in read if first <= shared[p][0] <= last)
        return self._owned[last + 1] - self._owned[first], read, owned

    def judge(self, cuts: tuple[int, ...], base: tuple | None = None, changed: range | None = None) -> tuple | None:
        """(step, figures, parameter bytes per rank, per-rank results) of ``cuts``; None when some
        rank cannot fit. ``base``: an earlier judgement whose stages differ from these in ``changed`` only."""
        self.judged += 1
        firsts = (0, *(c + 1 for c in cuts))
        lasts = (*cuts, len(self.costs) - 1)
        if base is None:
            results, todo = [None] * self.ranks, range(self.ranks)
        else:
            results, todo = list(base[3]), {self.stage_rank[s] for s in changed}
        for r in todo:
            result = self._rank_result(r, tuple((firsts[s], lasts[s]) for s in self.rank_stages[r]))
            if result is None:
                return None
            results[r] = result
        chosen: list = [None] * self.stages
        for r, result in enumerate(results):
            for s, option in zip(self.rank_stages[r], result[0]):
                chosen[s] = option
        rank_bytes = [result[2] for result in results]
        cut = StageCut(cuts=tuple(cuts), recompute=tuple(o[0] for o in chosen),
                       stage_time_s=tuple(o[1] for o in chosen), stage_weight_s=tuple(o[2] for o in chosen),
                       stage_memory_bytes=tuple(o[3] for o in chosen),
                       rank_memory_bytes=tuple(result[1] for result in results))
        return self.objective(cut, rank_bytes), cut, rank_bytes, results


def refine_cuts(judge: CutJudge, start: StageCut | None, *, enumerate_limit: int = ENUMERATE_LIMIT,
                radius: int = RADIUS) -> tuple[float, StageCut] | None:
    """The best cuts found (see the module's docstring), with their step; None if none fits."""
    blocks, stages = len(judge.costs), judge.stages
    if math.comb(blocks - 1, stages - 1) <= enumerate_limit:
        best = None
        for cuts in itertools.combinations(range(blocks - 1), stages - 1):
            judged = judge.judge(cuts)
            if judged is not None and (best is None or _better(judged, best)):
                best = judged
        return best[:2] if best is not None else None
    if start is None:
        return None
    best = judge.judge(start.cuts)
    if best is None:
        return None
    for _ in range(100 * len(judge.costs) + 100):  # _better's tolerances could, in principle, let moves cycle
        for move in _moves(judge, best, radius):
            judged = judge.judge(move[0], best, move[1])
            if judged is not None and _better(judged, best):
                best = judged
                break
        else:
            break  # no move is better: a local optimum
    return best[:2]


def _better(judged: tuple, than: tuple) -> bool:
    """A shorter step; at the same step, a shorter slowest stage. Cut sets that tie on the step
    (an interleaved rank's time is the sum of its stages', whatever their sizes) are not the same
    to the simulator, which runs the stages one by one: balanced ones keep the pipeline full."""
    if judged[0] < than[0] * (1 - 1e-12):
        return True
    return judged[0] <= than[0] * (1 + 1e-12) and max(judged[1].stage_time_s) < max(than[1].stage_time_s) * (1 - 1e-12)


def _moves(judge: CutJudge, judged: tuple, radius: int):
    """Cut sets near ``judged``'s, with the stages they change: ``delta`` blocks (up to
    ``radius``) passed from stage a to stage b by moving every cut between them, for a a stage
    that sets a term of the step and b its neighbours, the fastest stage or another such stage."""
    _, cut, rank_bytes, _ = judged
    cuts, stages, blocks = cut.cuts, judge.stages, len(judge.costs)
    critical = _critical_stages(judge, judged)
    times = cut.stage_time_s
    partners = set(critical) | {min(range(stages), key=times.__getitem__), 0, stages - 1}
    seen = set()
    for a in critical:
        for b in sorted(partners | {a - 1, a + 1}, key=lambda b: abs(b - a)):
            if not 0 <= b < stages or b == a or (abs(b - a) > SHIFT_SPAN and stages > FAR_STAGES):
                continue
            low, high = min(a, b), max(a, b)  # cuts low .. high - 1 move together
            for delta in range(1, radius + 1):
                step = -delta if a < b else delta  # towards a's end: a gives its last blocks
                moved = tuple(c + step if low <= i < high else c for i, c in enumerate(cuts))
                if moved in seen or not _valid(moved, blocks):
                    continue
                seen.add(moved)
                yield moved, range(low, high + 1)


def _valid(cuts: tuple[int, ...], blocks: int) -> bool:
    return all(x < y for x, y in zip(cuts, cuts[1:])) and (not cuts or (cuts[0] >= 0 and cuts[-1] <= blocks - 2))


def _critical_stages(judge: CutJudge, judged: tuple) -> list[int]:
    """The stages that set a term of the step: the slowest stage (and rank), the one with the
    least weight-gradient work, the rank holding the most parameters, and the stages that
    recompute more than a neighbour (a move may spare them the recompute)."""
    _, cut, rank_bytes, _ = judged
    times, weights = cut.stage_time_s, cut.stage_weight_s
    rank_time = [0.0] * judge.ranks
    for s, t in enumerate(times):
        rank_time[judge.stage_rank[s]] += t
    critical = {max(range(len(times)), key=times.__getitem__), min(range(len(weights)), key=weights.__getitem__)}
    critical.update(judge.rank_stages[max(range(judge.ranks), key=rank_time.__getitem__)])
    critical.update(judge.rank_stages[max(range(judge.ranks), key=rank_bytes.__getitem__)])
    lighter = {mode: k for k, mode in enumerate(RECOMPUTE_MODES)}
    modes = [lighter.get(mode, 0) for mode in cut.recompute]
    critical.update(s for s in range(len(modes)) if any(  # recomputes, next to a stage that recomputes less
        0 <= n < len(modes) and modes[n] < modes[s] for n in (s - 1, s + 1)))
    return sorted(critical)
