"""Cut a chain of blocks into pipeline stages fast: bisection on the slowest stage's time.

The whole-plan search (``autopart/search.py``) scores thousands of layouts (mesh shape,
micro-batch size, schedule, ...), and each needs its cuts. CP-SAT takes seconds per solve on
long chains; this takes milliseconds. For a bound ``T`` on every stage's time, cutting greedily
from the first block (each stage as long as it can be while its time is within ``T`` and its
rank's memory within the limit) finds a plan whenever any plan meets ``T``: a stage's time and
memory only grow as it takes more blocks, so a stage that ends later never leaves the next one
worse off. Bisection on ``T`` then gives the smallest slowest stage. Where the transfers at the
stages' ends are equal (a Transformer's residual stream) that is also the smallest
``sum T_s + (m - 1) max T_s``, the pipeline latency that ``autopart.solve.pipeline`` minimises
with CP-SAT, which the search still runs on its finalists.

Recompute is chosen per stage inside the cut: a stage takes the lightest recompute mode
(``RECOMPUTE_MODES`` in order) that keeps its rank within memory, and pays its time.

What this needs of the chain, per block, is ``ChainCosts`` (``autopart.solve.chain_costs``).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, replace

from autopart.ir.recompute import RECOMPUTE_MODES
from autopart.solve.chain_costs import ChainCosts, StageFigures, chain_sums, stage_figures
from autopart.solve.rank_room import RankRoom, rank_bytes, stages_by_rank

__all__ = ["StageCut", "cut_stages", "fixed_cut"]


@dataclass(frozen=True, kw_only=True)
class StageCut:
    cuts: tuple[int, ...]  # stage s ends after block cuts[s]
    recompute: tuple[str, ...]  # per stage
    stage_time_s: tuple[float, ...]  # forward + backward (+ recompute) + transfers, one microbatch
    stage_weight_s: tuple[float, ...]
    stage_memory_bytes: tuple[int, ...]
    rank_memory_bytes: tuple[int, ...]
    bound_s: float = 0.0  # from cut_stages, one stage per rank: no cuts have a smaller slowest stage


def cut_stages(
    costs: ChainCosts,
    *,
    stages: int,
    in_flight: tuple[int, ...],
    stage_rank: tuple[int, ...],
    transfer_s: tuple[float, ...],
    memory_limit_bytes: int,
    overhead_bytes: int,
    modes: tuple[tuple[str, ...], ...] | None = None,
    transient: tuple[int, ...] | None = None,
    precision: float = 1e-4,
    fit_only: bool = False,
    rank_in_flight: tuple[tuple[tuple[int, ...], ...], ...] | None = None,
) -> StageCut | None:
    """The cuts with the smallest slowest stage that fit in memory, or None if nothing fits.
    With ``fit_only``, any cuts that fit (the question is whether some do).

    ``transfer_s[k]``: one-way seconds of what crosses after block k (and of its gradient back,
    where one comes: `ChainCosts.gradient_transfer_s`). ``modes``: per stage, the
    recompute modes allowed (all three by default). ``transient``: per stage, the microbatches
    whose recomputed activations live at once (1 each by default; more where a zero-bubble W waits).

    A rank holding several stages (interleaved) is cut two ways, and the better kept: each stage
    an equal share of the rank's memory, with every stage at its own peak at once; and, with
    ``rank_in_flight`` (per rank, the moments that may be its peak, `autopart.solve.rank_room`),
    each stage taking what its rank has left, held at those moments, less what the rank's later
    stages need at the least. An equal share is pessimistic under interleaving: a rank's first
    chunk holds the most microbatches (and the embedding), its last the fewest, and the rank's
    fullest moment holds fewer than its chunks' peaks summed. The result's memory is the rank's
    peak at its fullest moment where ``rank_in_flight`` is given.
    """
    blocks = len(costs)
    if stages > blocks:
        return None
    modes = modes or (RECOMPUTE_MODES,) * stages
    ranks = max(stage_rank) + 1
    per_rank = [len(held) for held in stages_by_rank(stage_rank)]
    room_bytes = memory_limit_bytes - overhead_bytes  # per rank
    budget = [room_bytes // per_rank[stage_rank[s]] for s in range(stages)]
    if min(budget) <= 0 or costs.prefix("owned_state_bytes")[-1] > ranks * room_bytes:
        return None  # the ranks together cannot hold the parameters, however the chain is cut

    returning_s = costs.gradient_transfer_s(transfer_s)  # the gradient each stage sends back

    def stage(s: int, first: int, last: int, mode: str) -> StageFigures:
        return stage_figures(
            costs, first, last, mode=mode, in_flight=in_flight[s],
            transfer_in_s=returning_s[first - 1] if s > 0 else 0.0,
            transfer_out_s=transfer_s[last] if s < stages - 1 else 0.0,
            transient=transient[s] if transient else 1,
        )  # fmt: skip

    equal_share = _Greedy(costs=costs, stages=stages, modes=modes, budget=budget, in_flight=in_flight,
                          transfer_s=transfer_s, transient=transient)
    best = _bisected(equal_share, costs, stages, transfer_s, precision, fit_only)
    # the rank's room differs from the equal share in memory only: it can cut faster only under a
    # bound where the equal share found nothing because memory refused some stage (else no cuts
    # meet that bound at all), and the search asks for thousands of layouts
    if rank_in_flight is not None and max(per_rank) > 1 and equal_share.failed_for_memory \
            and not (best is not None and fit_only):
        room = RankRoom(stage_rank=stage_rank, moments=rank_in_flight, room_bytes=room_bytes,
                        reserve_bytes=_least_parameter_bytes(costs))
        found = _bisected(_Greedy(costs=costs, stages=stages, modes=modes, budget=budget, in_flight=in_flight,
                                  transfer_s=transfer_s, transient=transient, room=room),
                          costs, stages, transfer_s, precision, fit_only,
                          useless_from=best[0] if best is not None else math.inf)  # fmt: skip
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    if best is None:
        return None
    return replace(_finish(costs, best[2], stage, stage_rank, ranks, overhead_bytes, modes, rank_in_flight),
                   bound_s=best[1])


def _bisected(greedy: _Greedy, costs: ChainCosts, stages: int, transfer_s: tuple[float, ...], precision: float,
              fit_only: bool, useless_from: float = math.inf) -> tuple[float, float, list] | None:
    """(slowest stage's bound, the bound below which nothing was found, the chosen stages) by
    bisection on the bound; with ``fit_only``, the first stages found, under the loosest bound.
    ``useless_from``: a bound from which on stages are of no use to the caller (other cuts are
    as fast): a walk up the bounds that fails there gives up."""
    compute = greedy.compute
    worst_case = compute[-1] + sum(costs.forward_s) + 2 * sum(transfer_s) + 1e-9
    lo, hi = max(costs.largest_block_s(), compute[-1] / stages) * (1 - 1e-9), worst_case
    if greedy.room is not None:
        # Stages that take what their rank has left may leave its later stages too little under a
        # loose bound, where each stage is as long as memory allows: the bound is raised from the
        # least, step by step, to the first under which the stages fit
        # A failed pass fails alike under every bound below its next turn: the walk passes those
        bound, alike_below = lo, -math.inf
        while bound < worst_case:
            if bound >= alike_below:
                if greedy(bound, watch=True) is not None:
                    break
                if not greedy.bound_matters:
                    return None  # the pass would fail alike under every larger bound
                alike_below = greedy.next_turn * (1 - 1e-9)
            if bound >= useless_from:
                return None  # what it finds from here on has a slowest stage no faster
            lo, bound = bound, bound * _GROWTH
        hi = min(bound, worst_case)
    loose = greedy(hi)
    if loose is None or fit_only:
        return loose and (hi, 0.0, loose)
    # The stages found under a bound also meet any bound from their slowest stage's time up to
    # it, so a halving that lands there is feasible without a greedy pass (about 40% of the passes
    # at 1,536 GPUs). Where a stage's time and memory grow with its end, a pass would find those
    # very stages; where they do not (transfers that differ per boundary, a rank's room) the
    # stages kept meet the bound all the same.
    chosen, slowest = loose, greedy.slowest_s(loose)
    # A failed pass fails alike under every bound below its next turn, so the bisection goes
    # there (not past ``hi``: where passes are not monotone in the bound, one may fail above a
    # bound under which another succeeded). Where they are, this is the smallest slowest stage.
    while hi - lo > precision * hi:
        mid = (lo + hi) / 2
        found = chosen if slowest <= mid else greedy(mid)
        if found is not None:
            hi = mid
            if found is not chosen:
                chosen, slowest = found, greedy.slowest_s(found)
        else:
            lo = max(mid, min(greedy.next_turn * (1 - 1e-9), hi))
    # where passes are not monotone in the bound, a failed one says nothing of larger bounds, so
    # the floor reported is never above the slowest stage of the stages found
    return hi, min(lo, slowest), chosen


_GROWTH = 1.25  # the bound on the slowest stage, raised by this factor per step where stages share a rank


def _least_parameter_bytes(costs: ChainCosts) -> int:
    """The fewest parameter bytes a stage of one block holds: what a stage still to come needs at the least."""
    owned = costs.prefix("owned_state_bytes")
    return min(owned[k + 1] - owned[k] for k in range(len(costs)))


class _Greedy:
    """Per stage (last block, mode), each stage as long as a bound on its time allows, or None
    if some stage fits under the bound in no mode: the test that `cut_stages` bisects on."""

    def __init__(self, *, costs: ChainCosts, stages: int, modes: tuple[tuple[str, ...], ...], budget: list[int],
                 in_flight: tuple[int, ...], transfer_s: tuple[float, ...], transient: tuple[int, ...] | None,
                 room: RankRoom | None = None):
        self.costs, self.stages, self.modes, self.budget, self.room = costs, stages, modes, budget, room
        self.in_flight, self.transfer_s = in_flight, transfer_s
        self.returning_s = costs.gradient_transfer_s(transfer_s)  # the gradient a stage sends back over its first boundary
        self.transients = tuple(transient) if transient else (1,) * stages
        self.blocks = len(costs)
        self.sums = chain_sums(costs)
        self.compute = costs.prefix("compute_s")
        # a stage ending before this block holds its blocks' own parameters (`_Sums.read_again_from`)
        self.plain_before = self.sums.read_again_from if self.sums.split is None else -1
        self.cheapest_out = min(transfer_s, default=0.0)
        self.refusals = 0  # times a stage met its time bound in a mode but not its memory
        self.failed_for_memory = False  # some bound under which no cuts were found saw a refusal
        # A pass watched (on a ``monotone`` chain) notes whether a larger bound could make it go
        # otherwise: a stage that the bound on its time cut short where its memory allowed more.
        # Where none did, every larger bound makes the same stages, or fails alike
        self.bound_matters = True
        # The least bound above the last pass's under which one of its comparisons of a time with
        # the bound would go the other way: under any bound below it that pass goes exactly as it
        # did, so where it failed the bisection need not try them
        self.next_turn = math.inf

    @functools.cached_property
    def monotone(self) -> bool:
        """Whether a stage's time and memory only grow with its end, in every mode: no transfer
        after a block that exceeds the next block's compute plus the transfer after it, no layer
        that a cut splits costing more, no block keeping more under selective recompute than it
        saves. Then a stage refused at an end is refused at every later one. Asked by watched
        passes only, so that the search's other passes do not pay for it."""
        costs, transfer = self.costs, self.transfer_s
        steps = [f + b for f, b in zip(costs.forward_s, costs.backward_s)]
        return self.sums.split is None and all(k <= b for k, b in zip(costs.selective_saved_bytes, costs.saved_bytes)) \
            and all(transfer[k] <= transfer[k + 1] + steps[k + 1] for k in range(len(transfer) - 1))

    def fits(self, s: int, first: int, last: int, bound: float) -> str | None:
        """The first mode in which blocks ``first..last`` fit as stage ``s`` under ``bound``, if any."""
        # (the search asks this millions of times: the running sums are read inline, the bytes
        # as ``_Sums.parameters`` and ``_Sums.held`` add them; the seconds of "full" are the whole
        # forward again, never less than what `_Sums.seconds` gives layer by layer)
        transfer_in = self.returning_s[first - 1] if s > 0 else 0.0
        transfer_out = self.transfer_s[last] if s < self.stages - 1 else 0.0
        sums, end = self.sums, last + 1
        parameters = None  # the same in every mode: asked once, where the memory is asked
        computed = self.compute[end] - self.compute[first]
        for mode in self.modes[s]:
            repeated = sums.repeated[mode]
            seconds = computed if repeated is None else computed + (repeated[end] - repeated[first])
            seconds = seconds + transfer_in + transfer_out
            too_slow = seconds > bound
            if too_slow:
                if seconds < self.next_turn:
                    self.next_turn = seconds
                if self.bound_matters:
                    continue  # the memory would tell nothing more
            if parameters is None:
                parameters = sums.owned[end] - sums.owned[first] if last < self.plain_before \
                    else sums.parameters(first, last)
            if mode == "none" and (sums.seeds is None or first == 0) and last < sums.blocks - 1:  # `held`'s plain case
                per_microbatch, once = sums.saved[end] - sums.saved[first], 0
            else:
                per_microbatch, once = sums.held(first, last, mode, self.transients[s])
            if self.room is None:
                fitting = parameters + self.in_flight[s] * per_microbatch + once <= self.budget[s]
            else:
                fitting = self.room.fits(s, parameters, per_microbatch, once)
            if too_slow:
                if fitting:
                    self.bound_matters = True
                continue
            if fitting:
                return mode
            if self.room is None:
                self.refusals += 1
        return None

    def slowest_s(self, chosen: list[tuple[int, str]]) -> float:
        """The slowest stage's time (with its transfers) of stages the greedy pass found."""
        slowest, first = 0.0, 0
        for s, (last, mode) in enumerate(chosen):
            transfer_in = self.returning_s[first - 1] if s > 0 else 0.0
            transfer_out = self.transfer_s[last] if s < self.stages - 1 else 0.0
            compute_s = self.sums.seconds(first, last, mode)
            slowest, first = max(slowest, compute_s + transfer_in + transfer_out), last + 1
        return slowest

    def _take(self, s: int, first: int, last: int, mode: str) -> None:
        """Stage ``s`` is cut: its rank's room shrinks by what it holds."""
        if self.room is not None:
            self.room.take(s, self.sums.parameters(first, last), *self.sums.held(first, last, mode, self.transients[s]))

    def last_block(self, s: int, first: int, bound: float) -> tuple[int, str] | None:
        """The last block stage ``s`` (not the last stage) can end on from ``first``, and its mode."""
        latest = self.blocks - (self.stages - s)  # every later stage needs a block
        # No mode is faster than no recompute, so the compute alone caps the stage's end; at
        # that cap it usually fits, and otherwise bisection finds the last block it can end on
        # (longer stages only cost more).
        inbound = self.returning_s[first - 1] if s > 0 else 0.0
        compute = self.compute
        cap = bisect.bisect_right(compute, bound * (1 + 1e-9) + compute[first] - inbound - self.cheapest_out) - 2
        if cap < latest:  # the cap moves once the bound lets the stage's compute reach the next block
            reach = compute[cap + 2] - compute[first] + inbound + self.cheapest_out
            self.next_turn = min(self.next_turn, reach / (1 + 1e-9))
        lo, hi = first, max(first, min(latest, cap))
        capped = hi if cap < latest and not self.bound_matters else None  # a stage ending there a larger bound moves
        mode = self.fits(s, first, hi, bound)
        if mode is not None:
            lo = hi
        else:
            mode = self.fits(s, first, first, bound)
            if mode is None:
                return None
            hi -= 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = self.fits(s, first, mid, bound)
            if found is not None:
                lo, mode = mid, found
            else:
                hi = mid - 1
        if lo == capped:
            self.bound_matters = True
        return lo, mode

    def __call__(self, bound: float, watch: bool = False) -> list[tuple[int, str]] | None:
        refusals = self.refusals
        found = self._cut(bound, watch)
        self.failed_for_memory |= found is None and self.refusals > refusals
        return found

    def _cut(self, bound: float, watch: bool = False) -> list[tuple[int, str]] | None:
        self.bound_matters = not (watch and self.monotone)
        self.next_turn = math.inf
        result = []
        first = 0
        if self.room is not None:
            self.room.reset()
        for s in range(self.stages):
            if s == self.stages - 1:
                mode = self.fits(s, first, self.blocks - 1, bound)
                if mode is None:
                    return None
                result.append((self.blocks - 1, mode))
                break
            found = self.last_block(s, first, bound)
            if found is None:
                return None
            result.append(found)
            self._take(s, first, *found)
            first = found[0] + 1
        return result


def _finish(costs, chosen, stage, stage_rank, ranks, overhead_bytes, modes, moments=None) -> StageCut:
    """The figures of the chosen cuts, each stage with the lightest recompute that fits its rank;
    each rank's memory at its fullest moment where ``moments`` are given, else its stages' peaks summed."""
    cuts = tuple(last for last, _ in chosen[:-1])
    firsts = [0, *(c + 1 for c in cuts)]
    figures = [stage(s, firsts[s], last, mode) for s, (last, mode) in enumerate(chosen)]
    mine: list[list[StageFigures]] = [[] for _ in range(ranks)]
    for s, f in enumerate(figures):
        mine[stage_rank[s]].append(f)
    rank_memory = [overhead_bytes + (rank_bytes([f.parts for f in held], moments[r]) if moments
                                     else sum(f.memory_bytes for f in held)) for r, held in enumerate(mine)]
    return StageCut(
        cuts=cuts,
        recompute=tuple(mode for _, mode in chosen),
        stage_time_s=tuple(f.time_s for f in figures),
        stage_weight_s=tuple(f.weight_s for f in figures),
        stage_memory_bytes=tuple(f.memory_bytes for f in figures),
        rank_memory_bytes=tuple(rank_memory),
    )


def fixed_cut(costs: ChainCosts, cuts: tuple[int, ...], *, modes: tuple[tuple[str, ...], ...],
              in_flight: tuple[int, ...], transient: tuple[int, ...], stage_rank: tuple[int, ...],
              transfer_s: tuple[float, ...], memory_limit_bytes: int, overhead_bytes: int,
              rank_in_flight: tuple[tuple[tuple[int, ...], ...], ...] | None = None) -> StageCut | None:
    """Given cuts: each stage takes the lightest allowed recompute that fits an equal share of its
    rank; None where a rank's memory (as `_finish` counts it) breaks the limit."""
    stages = len(cuts) + 1
    lasts = [*cuts, len(costs) - 1]
    firsts = [0, *(c + 1 for c in cuts)]
    ranks = max(stage_rank) + 1
    per_rank = [len(held) for held in stages_by_rank(stage_rank)]

    returning_s = costs.gradient_transfer_s(transfer_s)  # the gradient each stage sends back

    def stage(s: int, first: int, last: int, mode: str) -> StageFigures:
        return stage_figures(costs, first, last, mode=mode, in_flight=in_flight[s],
                             transfer_in_s=returning_s[first - 1] if s > 0 else 0.0,
                             transfer_out_s=transfer_s[last] if s < stages - 1 else 0.0, transient=transient[s])

    chosen = []
    for s in range(stages):
        budget = (memory_limit_bytes - overhead_bytes) // per_rank[stage_rank[s]]
        for mode in modes[s]:
            if stage(s, firsts[s], lasts[s], mode).memory_bytes <= budget or mode == modes[s][-1]:
                break
        chosen.append((lasts[s], mode))
    cut = _finish(costs, chosen, stage, stage_rank, ranks, overhead_bytes, modes, rank_in_flight)
    return cut if max(cut.rank_memory_bytes) <= memory_limit_bytes else None
