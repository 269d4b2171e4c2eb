"""Cuts that fit in memory, found without CP-SAT, for the problems where CP-SAT finds none in time.

On long chains cut into many stages (an interleaved 96-layer model: 196 blocks, 48 stages, each
rank holding six) the balanced starting cuts may break the memory limit while CP-SAT, within
its time limit, finds neither a plan nor a proof that none exists. Then this gives one where it
can, and the least memory it reached where it cannot.

The cut is made from the last stage backwards. A stage's memory is its blocks' parameter state
plus their activations times the microbatches it keeps in flight, and every schedule keeps the
fewest in flight on the last stages (1F1B's stage i keeps p - i); so the stages where a block
costs least memory are filled first, each taking blocks while its time stays within a bound
``T`` and its rank's memory within the limit (less what the rank's stages still to be cut need
at the least: a block each). Bisection on ``T`` then gives the fitting cuts with the shortest
slowest stage that this finds. It is a heuristic: where it finds nothing, a plan may still exist.

`memory_lower_bound` says when none can: a linear relaxation of the cut (blocks split freely
between stages, in any order, each stage a block's worth at the least, each parameter paid
once) whose smallest fullest-rank memory no real cut can beat. Above the limit, the model does
not fit in this layout, whatever the time limit.
"""

from __future__ import annotations

import importlib
import math

from autopart.solve.bottleneck import cut_stages
from autopart.solve.chain_costs import ChainCosts
from autopart.solve.cut_problem import PipelineProblem, evaluate

__all__ = ["cutter_cuts", "fitting_cuts", "least_memory_bytes", "memory_lower_bound", "no_fit_message", "spread_cuts"]

_BISECTIONS = 40
_GROWTH = 1.25  # the bound on the slowest stage's time, raised by this factor per step
_STEPS = 200  # at most: the steps stop once the bound passes the whole chain's time


def least_memory_bytes(problem: PipelineProblem, *, upper_bytes: int) -> int:
    """The smallest memory limit under which this finds cuts, by bisection up to ``upper_bytes``
    (the memory of cuts known to exist): what the fullest device needs at the least, as far as
    this can tell."""
    low, high = 0, upper_bytes
    cheapest = _cheapest(problem)
    while high - low > max(1 << 20, high // 1000):
        middle = (low + high) // 2
        if _cut_from_the_end(problem, math.inf, memory_bytes=middle, cheapest=cheapest) is None:
            low = middle
        else:
            high = middle
    return high


def fitting_cuts(problem: PipelineProblem) -> tuple[int, ...] | None:
    """Cuts within the memory limit whose slowest stage is as short as bisection finds, or the
    stage lengths that spread memory evenly; None where neither fits."""
    spread = spread_cuts(problem)
    fits = max(evaluate(problem, spread).rank_memory_bytes) <= problem.memory_limit_bytes
    low, best = max(problem.block_time_s), None
    # memory does not shrink as the bound on time grows (the last stages take more of their ranks'
    # room), so the bound is raised step by step from the least, and bisected below the first that fits
    cheapest = _cheapest(problem)
    whole = sum(problem.block_time_s) + sum(problem.boundary_transfer_s)
    for step in range(_STEPS):
        bound = low * _GROWTH**step
        bound = bound if bound < whole else math.inf
        best = _cut_from_the_end(problem, bound, memory_bytes=problem.memory_limit_bytes, cheapest=cheapest)
        if best is not None or bound == math.inf:
            break
        low = bound
    if best is None:
        return spread if fits else None
    high = max(evaluate(problem, best).stage_time_s)
    for _ in range(_BISECTIONS):
        if high - low <= 1e-6 * high:
            break
        middle = (low + high) / 2
        cuts = _cut_from_the_end(problem, middle, memory_bytes=problem.memory_limit_bytes, cheapest=cheapest)
        if cuts is None:
            low = middle
        else:
            best, high = cuts, middle
    if fits and max(evaluate(problem, spread).stage_time_s) < high:
        return spread
    return best


def cutter_cuts(problem: PipelineProblem) -> tuple[int, ...] | None:
    """The search's cuts (`autopart.solve.bottleneck.cut_stages`: bisection on the slowest stage,
    each stage cut greedily from the first) for this problem, where they fit; None where they do not."""
    blocks = len(problem.block_time_s)
    zeros = (0,) * blocks
    # A layer a cut splits costs its stages what its parameters' root units hold more (ZeRO-3):
    # per block, that of the parameters first read there, as `autopart.solve.chain_costs` sums it.
    split = [0] * blocks
    for _, _, extra in problem.split_layers:
        for nbytes, readers in extra:
            split[readers[0]] += nbytes
    # The problem's activations are already those of its stages' recompute: the cutter keeps mode
    # "none", or, where a recompute rebuilds bytes in backward, "selective" with those bytes as what
    # it does not keep (held while the microbatches of `rebuilt_at_once` run their backward).
    rebuilt = problem.block_rebuilt_bytes
    saved = tuple(a + r for a, r in zip(problem.block_activation_bytes, rebuilt)) if rebuilt else problem.block_activation_bytes
    costs = ChainCosts(
        forward_s=problem.block_time_s, backward_s=(0.0,) * blocks, weight_s=(0.0,) * blocks, saved_bytes=saved,
        selective_saved_bytes=problem.block_activation_bytes if rebuilt else zeros, selective_recompute_s=(0.0,) * blocks,
        boundary_bytes=zeros[1:], boundary_gradients=problem.boundary_gradients, input_bytes=0,
        parameter_bytes=dict(problem.held_bytes), parameter_state_bytes=dict(problem.held_bytes),
        block_parameters=problem.block_held,
        layer_spans=tuple((first, end) for first, end, _ in problem.split_layers),
        split_layer_bytes=tuple(split) if any(split) else (), loss_working_bytes=problem.loss_working_bytes,
        weight_seed_bytes=problem.block_weight_seed_bytes,
    ).splitting_backward()  # fmt: skip
    cut = cut_stages(costs, stages=problem.stages, in_flight=problem.in_flight,
                     stage_rank=tuple(problem.rank_of(s) for s in range(problem.stages)),
                     transfer_s=problem.boundary_transfer_s, memory_limit_bytes=problem.memory_limit_bytes,
                     overhead_bytes=problem.overhead_bytes, modes=(("selective" if rebuilt else "none",),) * problem.stages,
                     transient=problem.rebuilt_at_once or problem.weight_seeds_at_once or None,
                     rank_in_flight=tuple(problem.moments(r) for r in range(problem.ranks)))  # fmt: skip
    if cut is None or max(evaluate(problem, cut.cuts).rank_memory_bytes) > problem.memory_limit_bytes:
        return None
    return cut.cuts


def spread_cuts(problem: PipelineProblem) -> tuple[int, ...]:
    """Stage lengths that make the ranks' memory as even as a linear program over the blocks'
    average costs can (stages that keep many microbatches in flight get few blocks), rounded to
    whole blocks."""
    linear = importlib.import_module("ortools.linear_solver.pywraplp")
    solver = linear.Solver.CreateSolver("GLOP")
    blocks, stages = len(problem.block_time_s), problem.stages
    scale = float(1 << 30)
    state = sum(problem.held_bytes.values()) / blocks / scale
    activation = sum(problem.block_activation_bytes) / blocks / scale
    length = [solver.NumVar(1.0, blocks, f"stage{s}_blocks") for s in range(stages)]
    peak = solver.NumVar(0.0, solver.infinity(), "peak")
    solver.Add(sum(length) == blocks)
    rebuilt = sum(problem.block_rebuilt_bytes) / blocks / scale
    seeds = sum(problem.block_weight_seed_bytes) / blocks / scale
    for rank in range(problem.ranks):
        mine = problem.rank_stages(rank)
        for held in problem.moments(rank):
            kept = sum(length[s] * (state + count * activation + _seeds_at_once(problem, s) * seeds)
                       for s, count in zip(mine, held))
            for s in mine if rebuilt else (None,):  # and the largest of its stages' rebuilt bytes
                solver.Add(kept + (0.0 if s is None else length[s] * _rebuilt_at_once(problem, s) * rebuilt) <= peak)
    solver.Minimize(peak)
    assert solver.Solve() == linear.Solver.OPTIMAL
    cuts, total = [], 0.0
    for s in range(stages - 1):
        total += length[s].solution_value()
        cuts.append(min(max(round(total) - 1, cuts[-1] + 1 if cuts else 0), blocks - stages + s))
    return tuple(cuts)


def _block_bytes(problem: PipelineProblem, k: int, kind: tuple[int, int, int], held: set[str]) -> int:
    """What block ``k`` adds to a stage of ``kind`` (``_stage_kind``) that holds the parameters
    ``held`` (exact on a rank of one stage; on a rank of several, which holds the largest stage's
    rebuilt bytes, more)."""
    in_flight, rebuilt_at_once, seeds_at_once = kind
    new = sum(problem.held_bytes[p] for p in set(problem.block_held[k]) - held)
    rebuilt = rebuilt_at_once * problem.block_rebuilt_bytes[k] if problem.block_rebuilt_bytes else 0
    seeds = seeds_at_once * problem.block_weight_seed_bytes[k] if problem.block_weight_seed_bytes else 0
    return new + in_flight * problem.block_activation_bytes[k] + rebuilt + seeds


def _rebuilt_at_once(problem: PipelineProblem, s: int) -> int:
    return problem.rebuilt_at_once[s] if problem.rebuilt_at_once else 0


def _seeds_at_once(problem: PipelineProblem, s: int) -> int:
    return problem.weight_seeds_at_once[s] if problem.weight_seeds_at_once else 0


def _stage_kind(problem: PipelineProblem, s: int) -> tuple[int, int, int]:
    """What stage ``s`` holds of each block's bytes: its microbatches in flight, those whose
    recomputed activations it rebuilds at once, and those whose weight-gradient seeds it keeps."""
    return problem.in_flight[s], _rebuilt_at_once(problem, s), _seeds_at_once(problem, s)


def _cheapest(problem: PipelineProblem) -> dict[tuple[int, int, int], int]:
    """Per stage kind (``_stage_kind``), the least memory a stage of one block needs."""
    blocks = range(len(problem.block_time_s))
    kinds = {_stage_kind(problem, s) for s in range(problem.stages)}
    return {kind: min(_block_bytes(problem, k, kind, set()) for k in blocks) for kind in kinds}


def _cut_from_the_end(
    problem: PipelineProblem, limit_s: float, *, memory_bytes: int, cheapest: dict[tuple[int, int, int], int]
) -> tuple[int, ...] | None:
    """Stages from the last backwards, each as long as ``limit_s`` and ``memory_bytes`` on its rank
    allow, one block at least; None where the cuts end up over either bound."""
    blocks, stages = len(problem.block_time_s), problem.stages
    used = [problem.overhead_bytes] * problem.ranks
    reserve = [0] * problem.ranks  # a block each, at the least, for the rank's stages still to be cut
    for s in range(stages - 1):
        reserve[problem.rank_of(s)] += cheapest[_stage_kind(problem, s)]
    starts: list[int] = []
    k = blocks - 1
    for s in range(stages - 1, -1, -1):
        rank = problem.rank_of(s)
        if s < stages - 1:
            reserve[rank] -= cheapest[_stage_kind(problem, s)]
        held: set[str] = set()
        time = problem.boundary_transfer_s[k] if s < stages - 1 else 0.0
        first = True
        while k >= s:  # leave a block for each stage before this one
            extra = _block_bytes(problem, k, _stage_kind(problem, s), held)
            lower = problem.gradient_transfer_s[k - 1] if k > 0 and s > 0 else 0.0  # the gradient it sends back
            over_time = time + problem.block_time_s[k] + lower > limit_s
            over_memory = used[rank] + extra + reserve[rank] > memory_bytes
            if not first and s > 0 and (over_time or over_memory):
                break
            used[rank] += extra
            held |= set(problem.block_held[k])
            time += problem.block_time_s[k]
            first = False
            k -= 1
        starts.append(k + 1)
    cuts = tuple(start - 1 for start in reversed(starts[:-1]))
    evaluation = evaluate(problem, cuts)
    if max(evaluation.rank_memory_bytes) > memory_bytes or max(evaluation.stage_time_s) > limit_s:
        return None
    return cuts


def memory_lower_bound(problem: PipelineProblem) -> int:
    """Bytes that the fullest rank holds at the least, whatever the cuts (see the module's docstring)."""
    linear = importlib.import_module("ortools.linear_solver.pywraplp")  # with OR-Tools, at first use
    solver = linear.Solver.CreateSolver("GLOP")
    blocks, stages = len(problem.block_time_s), problem.stages
    owner: dict[str, int] = {}  # each parameter (and buffer) paid once, by the first block that reads it
    for k in range(blocks):
        for name in problem.block_held[k]:
            owner.setdefault(name, k)
    state = [0] * blocks
    for name, k in owner.items():
        state[k] += problem.held_bytes[name]
    scale = float(1 << 30)  # GiB: keeps the coefficients near one
    share = [[solver.NumVar(0.0, 1.0, f"block{k}_on_stage{s}") for s in range(stages)] for k in range(blocks)]
    peak = solver.NumVar(0.0, solver.infinity(), "peak")
    for k in range(blocks):
        solver.Add(sum(share[k]) == 1)
    for s in range(stages):
        solver.Add(sum(share[k][s] for k in range(blocks)) >= 1)
    rebuilt = problem.block_rebuilt_bytes or (0,) * blocks
    seeds = problem.block_weight_seed_bytes or (0,) * blocks
    for rank in range(problem.ranks):
        for moment in problem.moments(rank):
            held = sum(
                share[k][s] * ((state[k] + count * problem.block_activation_bytes[k]
                                + _seeds_at_once(problem, s) * seeds[k]) / scale)
                for s, count in zip(problem.rank_stages(rank), moment) for k in range(blocks)
            )  # fmt: skip
            # the rank holds the largest of its stages' rebuilt bytes: any one of them at least
            for s in problem.rank_stages(rank) if problem.block_rebuilt_bytes else (None,):
                again = 0.0 if s is None else sum(share[k][s] * (_rebuilt_at_once(problem, s) * rebuilt[k] / scale)
                                                  for k in range(blocks))
                solver.Add(held + again + problem.overhead_bytes / scale <= peak)
    solver.Minimize(peak)
    status = solver.Solve()
    assert status == linear.Solver.OPTIMAL, status
    return math.floor(peak.solution_value() * scale * (1 - 1e-9))


def no_fit_message(problem: PipelineProblem, time_limit_s: float, *, upper_bytes: int) -> str:
    """One line for cuts that CP-SAT did not find in time and that this did not find within memory:
    the least memory found, and the bound below which no cut can go."""
    gib = 1 << 30
    found = min(least_memory_bytes(problem, upper_bytes=upper_bytes),
                max(evaluate(problem, spread_cuts(problem)).rank_memory_bytes))  # fmt: skip
    bound = memory_lower_bound(problem)
    limit = problem.memory_limit_bytes / gib
    if bound > problem.memory_limit_bytes:
        verdict = f"no cut fits: every one needs at least {bound / gib:.1f} GiB on some device"
    else:
        verdict = (f"no cut could be proven not to fit (none needs less than {bound / gib:.1f} GiB), but CP-SAT found none"
                   f" within --time-limit {time_limit_s:g} s")  # fmt: skip
    return (
        f"no pipeline cuts found within {limit:.1f} GiB per device ({problem.stages} stages, "
        f"{problem.microbatches} microbatches): the cuts that need least memory found need {found / gib:.1f} GiB on "
        f"the fullest device; {verdict}; "
        + ("use more stages (--pp), more tensor parallelism (--tp) or smaller microbatches, " if problem.block_rebuilt_bytes
           else "recompute activations (--recompute selective, full or stage), use more stages (--pp), ")
        + "or raise --memory or --time-limit"
    )
