"""The bisection cutter against every cut set of small random chains."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from autopart.ir.recompute import RECOMPUTE_MODES
from autopart.solve.bottleneck import cut_stages
from autopart.solve.chain_costs import ChainCosts, stage_figures


def random_chain(rng: random.Random, blocks: int, *, tied: bool) -> ChainCosts:
    forward = tuple(rng.uniform(1, 10) for _ in range(blocks))
    names = tuple((f"w{k}",) for k in range(blocks))
    if tied:  # the first and last blocks share a weight, as tied embeddings do
        names = (("emb", *names[0]), *names[1:-1], ("emb", *names[-1]))
    parameter_bytes = {p: rng.randrange(1, 50) for ps in names for p in ps}
    saved = tuple(rng.randrange(10, 100) for _ in range(blocks))
    return ChainCosts(
        forward_s=forward,
        backward_s=tuple(2 * f for f in forward),
        weight_s=tuple(f for f in forward),
        saved_bytes=saved,
        selective_saved_bytes=tuple(s // 2 for s in saved),
        selective_recompute_s=tuple(f / 4 for f in forward),
        boundary_bytes=(8,) * (blocks - 1),
        input_bytes=4,
        parameter_bytes=parameter_bytes,
        parameter_state_bytes={p: 4 * b for p, b in parameter_bytes.items()},
        block_parameters=names,
    )


def exhaustive(costs: ChainCosts, stages: int, in_flight, transfer, limit: int, returning=None):
    """The smallest slowest stage over every cut set, each stage with the lightest recompute that
    fits; ``returning``: per boundary, the gradient's time back over it (``transfer`` by default)."""
    returning = transfer if returning is None else returning
    blocks = len(costs)
    best = None
    for cuts in itertools.combinations(range(blocks - 1), stages - 1):
        firsts, lasts = [0, *(c + 1 for c in cuts)], [*cuts, blocks - 1]
        times = []
        for s in range(stages):
            for mode in RECOMPUTE_MODES:
                f = stage_figures(costs, firsts[s], lasts[s], mode=mode, in_flight=in_flight[s],
                                  transfer_in_s=returning[firsts[s] - 1] if s else 0.0,
                                  transfer_out_s=transfer[lasts[s]] if s < stages - 1 else 0.0)
                if f.memory_bytes <= limit:
                    times.append(f.time_s)
                    break
            else:
                break
        if len(times) == stages and (best is None or max(times) < best):
            best = max(times)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_bisection_finds_the_smallest_slowest_stage(seed: int) -> None:
    rng = random.Random(seed)
    blocks = rng.randint(3, 9)
    stages = rng.randint(2, min(4, blocks))
    costs = random_chain(rng, blocks, tied=seed % 2 == 0)
    in_flight = tuple(stages - s for s in range(stages))  # 1F1B's warm-up
    transfer = (0.5,) * (blocks - 1)
    total = sum(costs.parameter_state_bytes.values()) + stages * sum(costs.saved_bytes)
    limit = rng.choice([10**9, total // stages + rng.randrange(0, total // 2 + 1), total // (3 * stages)])
    expected = exhaustive(costs, stages, in_flight, transfer, limit)
    cut = cut_stages(costs, stages=stages, in_flight=in_flight, stage_rank=tuple(range(stages)),
                     transfer_s=transfer, memory_limit_bytes=limit, overhead_bytes=0)
    if expected is None:
        assert cut is None
        return
    assert cut is not None
    assert max(cut.stage_time_s) == pytest.approx(expected, rel=2e-4)
    assert cut.bound_s <= expected * (1 + 1e-12)  # no cuts are faster than the bound it reports
    assert max(cut.rank_memory_bytes) <= limit
    # the stage figures it reports are those of its cuts and modes
    firsts = [0, *(c + 1 for c in cut.cuts)]
    lasts = [*cut.cuts, blocks - 1]
    for s in range(stages):
        f = stage_figures(costs, firsts[s], lasts[s], mode=cut.recompute[s], in_flight=in_flight[s],
                          transfer_in_s=transfer[firsts[s] - 1] if s else 0.0,
                          transfer_out_s=transfer[lasts[s]] if s < stages - 1 else 0.0)
        assert f.time_s == pytest.approx(cut.stage_time_s[s])


def test_recompute_is_chosen_only_where_memory_needs_it() -> None:
    rng = random.Random(7)
    costs = random_chain(rng, 8, tied=False)
    kwargs = dict(stages=2, in_flight=(2, 1), stage_rank=(0, 1), transfer_s=(0.0,) * 7, overhead_bytes=0)
    roomy = cut_stages(costs, memory_limit_bytes=10**9, **kwargs)
    assert roomy.recompute == ("none", "none")
    tight_limit = max(roomy.rank_memory_bytes) - 1
    tight = cut_stages(costs, memory_limit_bytes=tight_limit, **kwargs)
    assert tight is not None and max(tight.rank_memory_bytes) <= tight_limit
    assert max(tight.stage_time_s) >= max(roomy.stage_time_s)
    none_only = cut_stages(costs, memory_limit_bytes=tight_limit, modes=(("none",), ("none",)), **kwargs)
    if none_only is not None:
        assert none_only.recompute == ("none", "none")


def test_full_recompute_layer_by_layer_or_the_stage_whole_whichever_fits() -> None:
    """Eight blocks: an embedding, three layers of two blocks, a head. One microbatch in flight:
    full recompute (one layer rebuilt at a time) fits where the stage whole (every activation
    rebuilt at once) does not. Eight in flight: each layer's input kept eight times outgrows what
    the stage whole rebuilds once, and the stage whole is taken."""
    base = random_chain(random.Random(5), 8, tied=False).changed(
        saved_bytes=(400, 60, 60, 60, 60, 60, 60, 400), layer_spans=((1, 3), (3, 5), (5, 7)))
    costs = base.checkpointing_layers()
    kwargs = dict(stages=1, stage_rank=(0,), transfer_s=(0.0,) * 7, overhead_bytes=0)
    for in_flight, chosen in ((1, "full"), (8, "stage")):
        memory = {mode: stage_figures(costs, 0, 7, mode=mode, in_flight=in_flight, transfer_in_s=0.0,
                                      transfer_out_s=0.0).memory_bytes for mode in RECOMPUTE_MODES}
        assert memory[chosen] == min(memory.values()), memory  # the premise: only the chosen mode fits
        cut = cut_stages(costs, in_flight=(in_flight,), memory_limit_bytes=memory[chosen], **kwargs)
        assert cut is not None and cut.recompute == (chosen,)
        assert cut_stages(costs, in_flight=(in_flight,), memory_limit_bytes=memory[chosen] - 1, **kwargs) is None
    # without the layers' spans (or under a split backward) full is the stage whole
    assert stage_figures(base, 0, 7, mode="full", in_flight=1, transfer_in_s=0.0, transfer_out_s=0.0) == \
        stage_figures(base, 0, 7, mode="stage", in_flight=1, transfer_in_s=0.0, transfer_out_s=0.0)


def reference_cut_stages(costs, *, stages, in_flight, transfer, limit):
    """The cutter as it was before its speed-ups (bisection over every block for each stage's
    end, every figure from stage_figures), one stage per rank: the faster one must agree."""
    blocks = len(costs)

    def fits(s, first, last, bound):
        for mode in RECOMPUTE_MODES:
            f = stage_figures(costs, first, last, mode=mode, in_flight=in_flight[s],
                              transfer_in_s=transfer[first - 1] if s else 0.0,
                              transfer_out_s=transfer[last] if s < stages - 1 else 0.0)
            if f.memory_bytes <= limit and f.time_s <= bound:
                return mode
        return None

    def greedy(bound):
        result, first = [], 0
        for s in range(stages):
            if s == stages - 1:
                mode = fits(s, first, blocks - 1, bound)
                return None if mode is None else [*result, (blocks - 1, mode)]
            if fits(s, first, first, bound) is None:
                return None
            lo, hi = first, blocks - (stages - s)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(s, first, mid, bound) is not None else (lo, mid - 1)
            result.append((lo, fits(s, first, lo, bound)))
            first = lo + 1

    compute = costs.prefix("compute_s")
    worst = compute[-1] + sum(costs.forward_s) + 2 * sum(transfer) + 1e-9
    if greedy(worst) is None:
        return None
    lo = max(max(f + b for f, b in zip(costs.forward_s, costs.backward_s)), compute[-1] / stages) * (1 - 1e-9)
    hi = worst
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if greedy(mid) is not None else (mid, hi)
    chosen = greedy(hi)
    return tuple(last for last, _ in chosen[:-1]), tuple(mode for _, mode in chosen)


@pytest.mark.parametrize("seed", range(30))
def test_a_stage_after_a_frozen_prefix_sends_no_gradient_back(seed: int) -> None:
    """Behind a frozen prefix no gradient crosses a cut (``ChainCosts.boundary_gradients``): the
    stage after it sends none back, and the cutter finds the smallest slowest stage so charged.
    It charged a gradient at every cut, as the plan it made then did not."""
    rng = random.Random(2000 + seed)
    blocks = rng.randint(3, 9)
    stages = rng.randint(2, min(4, blocks))
    frozen = rng.randint(1, blocks - 1)
    costs = random_chain(rng, blocks, tied=False).changed(
        boundary_gradients=tuple(k >= frozen for k in range(blocks - 1)))
    in_flight = tuple(stages - s for s in range(stages))
    transfer = (rng.choice([0.5, 3.0]),) * (blocks - 1)
    returning = tuple(t if k >= frozen else 0.0 for k, t in enumerate(transfer))
    assert costs.gradient_transfer_s(transfer) == returning
    expected = exhaustive(costs, stages, in_flight, transfer, 10**9, returning)
    cut = cut_stages(costs, stages=stages, in_flight=in_flight, stage_rank=tuple(range(stages)),
                     transfer_s=transfer, memory_limit_bytes=10**9, overhead_bytes=0)
    assert max(cut.stage_time_s) == pytest.approx(expected, rel=2e-4)
    firsts, lasts = [0, *(c + 1 for c in cut.cuts)], [*cut.cuts, blocks - 1]
    for s in range(1, stages):  # each stage after a cut: the gradient it sends back, where one comes
        f = stage_figures(costs, firsts[s], lasts[s], mode=cut.recompute[s], in_flight=in_flight[s],
                          transfer_in_s=returning[firsts[s] - 1],
                          transfer_out_s=transfer[lasts[s]] if s < stages - 1 else 0.0)
        assert f.time_s == pytest.approx(cut.stage_time_s[s])


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_cutter_gives_the_reference_cutters_answers(seed: int) -> None:
    rng = random.Random(1000 + seed)
    blocks = rng.randint(3, 30)
    stages = rng.randint(2, min(8, blocks))
    costs = random_chain(rng, blocks, tied=seed % 2 == 0)
    in_flight = tuple(stages - s for s in range(stages))
    transfer = (0.5,) * (blocks - 1)  # equal, as a Transformer's residual stream: the greedy is exact
    total = sum(costs.parameter_state_bytes.values()) + stages * sum(costs.saved_bytes)
    limit = rng.choice([10**9, total // stages + rng.randrange(0, total // 2 + 1), total // (3 * stages)])
    expected = reference_cut_stages(costs, stages=stages, in_flight=in_flight, transfer=transfer, limit=limit)
    cut = cut_stages(costs, stages=stages, in_flight=in_flight, stage_rank=tuple(range(stages)),
                     transfer_s=transfer, memory_limit_bytes=limit, overhead_bytes=0)
    if expected is None:
        assert cut is None
        return
    assert (cut.cuts, cut.recompute) == expected
    assert cut.bound_s <= max(cut.stage_time_s)
    # no cut set has a slower slowest stage than the bound says, if it fits
    if blocks <= 10:
        assert exhaustive(costs, stages, in_flight, transfer, limit) >= cut.bound_s


def test_with_state_is_the_state_of_every_parameter() -> None:
    costs = random_chain(random.Random(5), 9, tied=True)
    layered = frozenset(sorted(costs.parameter_bytes)[1::2])  # a repeated layer's: their state differs at ZeRO-3
    costs = costs.changed(layer_parameters=layered)
    held = costs.with_state(lambda nbytes, layered=False: 3 * nbytes + (0 if layered else 7))
    assert held.parameter_state_bytes == {p: 3 * b + (p not in layered) * 7 for p, b in costs.parameter_bytes.items()}
    slow = ChainCosts(**{f.name: getattr(held, f.name) for f in dataclasses.fields(held) if f.name != "_kept"})
    assert held.prefix("owned_state_bytes") == slow.prefix("owned_state_bytes")
    assert held.shared_parameters == slow.shared_parameters == {"emb": (0, 8)}


def test_interleaved_stages_share_their_ranks_memory_as_the_ranks_moments_hold_it() -> None:
    """Interleaved 1F1B, 2 ranks of 2 chunks, 4 microbatches: rank 0's chunks hold (3, 2) or (4, 1)
    microbatches at once, never their peaks (4, 2). Eight alike blocks, two per stage, fit a rank
    at 1,160 bytes; an equal share of 1,200 per chunk (600) takes one block on the first chunk
    and leaves the last with four. Sharing the rank as its moments hold it finds the even split."""
    from autopart.predict.in_flight import in_flight, rank_in_flight

    blocks = 8
    costs = _alike_blocks(blocks, saved_bytes=100)
    common = dict(stages=4, in_flight=in_flight("interleaved", 2, 4, 2), stage_rank=(0, 1, 0, 1),
                  transfer_s=(0.0,) * (blocks - 1), memory_limit_bytes=1200, overhead_bytes=0,
                  modes=(("none",),) * 4)  # fmt: skip
    shared = cut_stages(costs, **common, rank_in_flight=rank_in_flight("interleaved", 2, 4, 2))
    assert shared.cuts == (1, 3, 5)
    assert shared.rank_memory_bytes == (4 * 40 + (3 + 2) * 200, 4 * 40 + 3 * 200)  # 200 bytes a microbatch a stage
    equal = cut_stages(costs, **common)
    assert max(equal.stage_time_s) >= 2 * max(shared.stage_time_s) == 2 * 6.0


def test_ranks_that_cannot_hold_the_parameters_together_are_refused_before_any_cut(monkeypatch) -> None:
    """Eight blocks of 40 bytes of state each (320 in all) on 2 ranks of 2 interleaved chunks: no
    cut fits ranks of 159 bytes, and the cutter says so without a greedy pass, which at a
    thousand stages would walk every bound up to the chain's whole time; at 160 it cuts."""
    from autopart.predict.in_flight import in_flight, rank_in_flight

    blocks = 8
    costs = _alike_blocks(blocks, saved_bytes=0)
    passes = _counted_passes(monkeypatch)
    common = dict(stages=4, in_flight=in_flight("interleaved", 2, 4, 2), stage_rank=(0, 1, 0, 1),
                  transfer_s=(0.0,) * (blocks - 1), overhead_bytes=0, rank_in_flight=rank_in_flight("interleaved", 2, 4, 2))
    assert cut_stages(costs, memory_limit_bytes=159, **common) is None and passes == []
    fitted = cut_stages(costs, memory_limit_bytes=160, **common)
    assert fitted is not None and fitted.rank_memory_bytes == (160, 160) and passes


def _counted_passes(monkeypatch) -> list[float]:
    """The bounds of the cutter's greedy passes, appended as they run."""
    from autopart.solve import bottleneck

    passes = []
    greedy = bottleneck._Greedy.__call__
    monkeypatch.setattr(bottleneck._Greedy, "__call__",
                        lambda self, bound, **how: passes.append(bound) or greedy(self, bound, **how))
    return passes


def _interleaved_case(seed: int) -> tuple[ChainCosts, dict, list[int]]:
    """A random chain on 2 ranks of two interleaved chunks, the cutter's arguments but the memory
    limit, and six limits from hopeless to roomy."""
    from autopart.predict.in_flight import in_flight, rank_in_flight

    rng = random.Random(seed)
    blocks, p, m = rng.randrange(6, 14), 2, rng.choice((2, 4, 6))
    costs = random_chain(rng, blocks, tied=rng.random() < 0.5)
    common = dict(stages=2 * p, in_flight=in_flight("interleaved", p, m, 2), stage_rank=(0, 1, 0, 1),
                  transfer_s=tuple(rng.uniform(0, rng.choice((2, 40))) for _ in range(blocks - 1)), overhead_bytes=10,
                  rank_in_flight=rank_in_flight("interleaved", p, m, 2))  # fmt: skip
    return costs, common, [rng.randrange(100, 3000) for _ in range(6)]


def _alike_blocks(blocks: int, *, saved_bytes: int) -> ChainCosts:
    """A chain of blocks alike: 1 s forward, 2 s backward, 40 bytes of state each."""
    return ChainCosts(
        forward_s=(1.0,) * blocks, backward_s=(2.0,) * blocks, weight_s=(1.0,) * blocks,
        saved_bytes=(saved_bytes,) * blocks, selective_saved_bytes=(0,) * blocks, selective_recompute_s=(0.0,) * blocks,
        boundary_bytes=(0,) * (blocks - 1), input_bytes=0, parameter_bytes={f"w{k}": 10 for k in range(blocks)},
        parameter_state_bytes={f"w{k}": 40 for k in range(blocks)}, block_parameters=tuple((f"w{k}",) for k in range(blocks)),
    )  # fmt: skip


def _never_stop_the_walk(monkeypatch) -> None:
    """The walk up the ranks' room bounds never stops early: their chains are taken as not
    monotone (the equal share's, as they are, so that its bisection goes as it did)."""
    from autopart.solve import bottleneck

    monotone = bottleneck._Greedy.monotone.func
    monkeypatch.setattr(bottleneck._Greedy, "monotone", property(lambda self: self.room is None and monotone(self)))


def test_a_rank_whose_first_stage_fits_no_block_under_any_bound_is_refused_after_one_pass(monkeypatch) -> None:
    """Eight blocks alike (40 bytes of state, 100 saved a microbatch, no recompute allowed) on 2
    ranks of 2 interleaved chunks at 300 bytes a rank: the parameters fit the ranks together,
    but no chunk holds one block with the microbatches it keeps in flight. The ranks' room is
    walked from the least bound upwards; its first pass is refused for memory alone, so every
    larger bound fails alike and the walk stops there, with the answer it would have reached."""
    from autopart.predict.in_flight import in_flight, rank_in_flight

    blocks = 8
    costs = _alike_blocks(blocks, saved_bytes=100)
    common = dict(stages=4, in_flight=in_flight("interleaved", 2, 4, 2), stage_rank=(0, 1, 0, 1),
                  transfer_s=(0.0,) * (blocks - 1), overhead_bytes=0, memory_limit_bytes=300, modes=(("none",),) * 4,
                  rank_in_flight=rank_in_flight("interleaved", 2, 4, 2))  # fmt: skip
    passes = _counted_passes(monkeypatch)
    assert cut_stages(costs, **common) is None
    assert len(passes) == 2  # the equal share's loosest bound, the ranks' room's least
    passes.clear()
    _never_stop_the_walk(monkeypatch)
    assert cut_stages(costs, **common) is None and len(passes) > 5  # walked up to the chain's whole time


@pytest.mark.parametrize("seed", range(40))
def test_stopping_the_walk_where_no_larger_bound_helps_never_changes_the_cuts(seed: int, monkeypatch) -> None:
    """Random chains on ranks of two interleaved chunks, at memory limits from hopeless to roomy:
    the cutter gives what it gives with the walk up the bounds never stopped early."""
    costs, common, limits = _interleaved_case(seed)
    stopped = [cut_stages(costs, memory_limit_bytes=limit, **common) for limit in limits]
    _never_stop_the_walk(monkeypatch)
    assert stopped == [cut_stages(costs, memory_limit_bytes=limit, **common) for limit in limits]


@pytest.mark.parametrize(("blocks", "stages"), [(100, 8), (64, 7), (1000, 96)])
def test_a_failed_pass_lets_the_bisection_skip_the_bounds_that_would_fail_alike(blocks, stages, monkeypatch) -> None:
    """Blocks alike, memory to spare: a pass under a bound fails alike under every bound up to the
    first that lets some stage take one more block, so the bisection jumps there. It lands on
    the best slowest stage itself (its bound is that stage's time, not within 1e-4 of it) in a
    dozen passes, where halving the bound's range down to 1e-4 took 13 to 17."""
    passes = _counted_passes(monkeypatch)
    cut = cut_stages(_alike_blocks(blocks, saved_bytes=100), stages=stages, in_flight=(1,) * stages,
                     stage_rank=tuple(range(stages)), transfer_s=(0.0,) * (blocks - 1), overhead_bytes=0,
                     memory_limit_bytes=1 << 40)
    best = 3.0 * -(-blocks // stages)  # the longest stage's blocks, 3 s each (forward and backward)
    assert max(cut.stage_time_s) == best
    assert cut.bound_s == pytest.approx(best, rel=1e-8)
    assert len(passes) <= 12


@pytest.mark.parametrize("seed", range(40))
def test_the_ranks_room_walk_gives_up_only_where_it_could_not_beat_the_equal_share(seed: int, monkeypatch) -> None:
    """Random chains on ranks of two interleaved chunks: giving up the walk up the ranks' room
    bounds once they reach the equal share's slowest stage changes no answer, and saves passes."""
    from autopart.solve import bottleneck

    costs, common, limits = _interleaved_case(seed)
    passes = _counted_passes(monkeypatch)
    given_up = [cut_stages(costs, memory_limit_bytes=limit, **common) for limit in limits]
    fewer = len(passes)
    bisected = bottleneck._bisected
    monkeypatch.setattr(bottleneck, "_bisected", lambda *args, useless_from=None: bisected(*args))
    assert given_up == [cut_stages(costs, memory_limit_bytes=limit, **common) for limit in limits]
    assert fewer <= len(passes) - fewer


def test_the_walk_passes_the_bounds_under_which_a_failed_pass_would_fail_alike(monkeypatch) -> None:
    """Random chains on ranks of two interleaved chunks: the walk up the ranks' room bounds runs
    no pass under a bound below the last failed one's next turn (its comparisons would all go
    as they went): the cuts are those it gives where it runs them all, and fewer passes run."""
    from autopart.solve import bottleneck

    passes = _counted_passes(monkeypatch)
    cases = [_interleaved_case(seed) for seed in range(40)]
    skipping = [[cut_stages(costs, memory_limit_bytes=limit, **common) for limit in limits]
                for costs, common, limits in cases]
    skipped = len(passes)
    passes.clear()
    counted = bottleneck._Greedy.__call__

    def forgetting(self, bound, watch=False):  # a watched pass that fails says nothing of larger bounds
        found = counted(self, bound, watch=watch)
        if watch and found is None:
            self.next_turn = -math.inf
        return found

    monkeypatch.setattr(bottleneck._Greedy, "__call__", forgetting)
    assert skipping == [[cut_stages(costs, memory_limit_bytes=limit, **common) for limit in limits]
                        for costs, common, limits in cases]
    assert skipped < len(passes)


@pytest.mark.parametrize("seed", range(300))
def test_the_bound_reported_is_never_above_the_cuts_found(seed: int) -> None:
    """Transfers that differ per boundary: a pass may fail under a bound between two that
    succeed. The bound the cutter reports (the bisection's floor) still stays at or under the
    slowest stage of the cuts it returns."""
    rng = random.Random(seed)
    blocks = rng.randrange(6, 30)
    costs = random_chain(rng, blocks, tied=rng.random() < 0.5)
    stages = rng.randint(2, min(6, blocks))
    transfer = tuple(rng.uniform(0, rng.choice((0.01, 2, 40))) for _ in range(blocks - 1))
    for limit in [rng.randrange(100, 4000) for _ in range(3)] + [10**9]:
        cut = cut_stages(costs, stages=stages, in_flight=tuple(stages - s for s in range(stages)),
                         stage_rank=tuple(range(stages)), transfer_s=transfer, memory_limit_bytes=limit, overhead_bytes=10)
        assert cut is None or cut.bound_s <= max(cut.stage_time_s)
