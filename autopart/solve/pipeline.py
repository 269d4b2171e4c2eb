"""Choose the pipeline cuts with OR-Tools CP-SAT.

The problem is a chain of blocks to be cut into ``stages`` contiguous stages. A stage's time per
microbatch is its blocks' forward and backward time plus the transfers at its two ends (the
activation it sends forward, the gradient it sends back: none where nothing crossing its first
boundary needs one, ``PipelineProblem.boundary_gradients``). The objective is Alpa's pipeline
latency, ``sum_s T_s + (microbatches - 1) * max_s T_s``, which the bubble makes the right one:
the slowest stage is paid once per microbatch, the others once per step.

Memory per rank (a rank may hold several stages): the model state of every parameter it reads (a parameter read by two stages,
such as tied embeddings, is held and paid for by both), the activations saved for backward times
the microbatches that the schedule keeps in flight on that stage, and a fixed overhead per rank.
A rank that holds several stages has them at their own peaks at different moments: its
activations are bounded at each moment that may be its peak (``PipelineProblem.rank_in_flight``).
At ZeRO-3 a cut inside a repeated layer makes the stages that read its parameters hold them in
their root units, whole beside the shards (``PipelineProblem.split_layers``): the model pays it
where a cut falls inside, so a tight memory limit moves cuts between layers. At ZeRO-1 the
replica that owns a rank's largest tensors holds them whole (``PipelineProblem.owned_state``),
which no linear term says: where CP-SAT's cuts break a rank's limit by it, `solve_cuts` adds a
bound for the rank's largest tensor or rules out the rank's spans, and solves again.

``solve_cuts(problem, time_limit_s=...)`` returns the cuts; ``evaluate(problem, cuts)`` computes
the same figures in plain Python (`autopart.solve.cut_problem`), used to re-check every solution and by the tests' exhaustive
enumeration.
"""

from __future__ import annotations

import time

from autopart.ir.errors import InfeasibleError, gib_beside
from autopart.solve import fitting
from autopart.solve._cp_sat import cp_model
from autopart.solve.cut_problem import CutEvaluation, CutSolution, PipelineProblem, evaluate, largest_owned, stage_ranges

__all__ = ["PipelineProblem", "CutEvaluation", "CutSolution", "evaluate", "solve_cuts", "stage_ranges"]

_NS = 1e9  # CP-SAT works on integers: times in nanoseconds


class _CutModel:
    """The CP-SAT model. ``x[k][s]``: block k is on stage s; ``end[k][s]``: stage s ends after block k."""

    def __init__(self, problem: PipelineProblem):
        self.problem = problem
        self.model = cp_model.CpModel()
        self._seeds: dict[int, cp_model.IntVar | int] = {}  # per rank, `rank_seeds`
        blocks, stages = len(problem.block_time_s), problem.stages
        m = self.model
        self.x = [[m.new_bool_var(f"block{k}_on_stage{s}") for s in range(stages)] for k in range(blocks)]
        for k in range(blocks):
            m.add_exactly_one(self.x[k])
        m.add(self.x[0][0] == 1)
        m.add(self.x[blocks - 1][stages - 1] == 1)
        self.stage_of = [m.new_int_var(0, stages - 1, f"stage_of_block{k}") for k in range(blocks)]
        for k in range(blocks):
            m.add(self.stage_of[k] == sum(s * self.x[k][s] for s in range(stages)))
        for k in range(blocks - 1):
            m.add(self.stage_of[k + 1] - self.stage_of[k] >= 0)
            m.add(self.stage_of[k + 1] - self.stage_of[k] <= 1)
        self.end = [[m.new_bool_var(f"stage{s}_ends_after_block{k}") for s in range(stages - 1)] for k in range(blocks - 1)]
        for k in range(blocks - 1):
            for s in range(stages - 1):
                e, here, there = self.end[k][s], self.x[k][s], self.x[k + 1][s + 1]
                m.add_implication(e, here)
                m.add_implication(e, there)
                m.add_bool_or([e, here.Not(), there.Not()])
        for s in range(stages - 1):
            m.add_exactly_one(self.end[k][s] for k in range(blocks - 1))
        self.readers: dict[str, list[int]] = {}
        for k, names in enumerate(problem.block_held):
            for name in dict.fromkeys(names):
                self.readers.setdefault(name, []).append(k)
        self.state = self._by_block(problem.held_bytes)
        # ZeRO-1: each parameter's share of its owned state, which `owner_bound` takes off a rank
        self.shares = self._by_block({name: nbytes // problem.replicas for name, (nbytes, _) in problem.owned_state.items()})
        self._holds: dict[tuple[str, str], cp_model.IntVar] = {}
        self.split = [self._split(first, end) for first, end, _ in problem.split_layers]

    def _by_block(self, nbytes_of: dict[str, int]) -> tuple[list[int], list[tuple[str, int, list[int]]]]:
        """``nbytes_of`` per parameter as per-block bytes where one block reads the parameter (its
        stage holds it: no variable per stage and parameter, of which 1,024 layers on 256 stages
        would need millions), and (name, bytes, the blocks that read it) for the others."""
        own, shared = [0] * len(self.problem.block_time_s), []
        for name, nbytes in nbytes_of.items():
            read = self.readers.get(name, [])
            if len(read) == 1:
                own[read[0]] += nbytes
            elif read:
                shared.append((name, nbytes, read))
        return own, shared

    def _held(self, name: str, stages: list[int], where: str) -> cp_model.IntVar:
        """Whether any of ``stages`` (named ``where``: a stage or a rank) reads ``name``."""
        if (name, where) not in self._holds:
            held = self.model.new_bool_var(f"{where}_holds_{name}")
            self.model.add_max_equality(held, [self.x[k][s] for k in self.readers[name] for s in stages])
            self._holds[name, where] = held
        return self._holds[name, where]

    def _split(self, first: int, end: int) -> cp_model.IntVar:
        """Whether a cut falls inside the layer of blocks ``first..end - 1``."""
        split = self.model.new_bool_var(f"cut_inside_blocks_{first}_to_{end - 1}")
        inside = [self.stage_of[k + 1] - self.stage_of[k] for k in range(first, end - 1)]
        if inside:
            self.model.add_max_equality(split, inside)
        else:  # a layer of one block: no cut splits it
            self.model.add(split == 0)
        return split

    def stage_time(self, s: int) -> cp_model.LinearExpr:
        p, blocks = self.problem, len(self.problem.block_time_s)
        compute = sum(round(p.block_time_s[k] * _NS) * self.x[k][s] for k in range(blocks))
        transfer = 0
        for k in range(blocks - 1):
            if s < p.stages - 1:  # the activation it sends forward
                transfer += round(p.boundary_transfer_s[k] * _NS) * self.end[k][s]
            if s > 0:  # the gradient it sends back, where one comes
                transfer += round(p.gradient_transfer_s[k] * _NS) * self.end[k][s - 1]
        return compute + transfer

    def stage_state(self, s: int, by_block: tuple | None = None) -> cp_model.LinearExpr:
        """Bytes of the parameters' weights, gradients and optimizer state that stage ``s`` holds
        (of ``by_block``, `_by_block`'s, its parameters' bytes alone)."""
        m = self.model
        own, shared = by_block or self.state
        holds = [nbytes * self._held(name, [s], f"stage{s}") for name, nbytes, _ in shared]  # once however many read it
        if by_block is not None:
            return sum(holds) + sum(nbytes * self.x[k][s] for k, nbytes in enumerate(own) if nbytes)
        for split, (first, end, extra) in zip(self.split, self.problem.split_layers):
            for n, (nbytes, readers) in enumerate(extra):  # paid where the stage reads them and a cut splits the layer
                paid = m.new_bool_var(f"stage{s}_holds_split_layer_{first}_part{n}")
                for k in readers:
                    m.add(paid >= self.x[k][s] + split - 1)
                holds.append(nbytes * paid)
        return sum(holds) + sum(nbytes * self.x[k][s] for k, nbytes in enumerate(own) if nbytes)

    def rule_out(self, rank: int, spans: tuple[tuple[int, int], ...]) -> None:
        """No cuts in which the rank's stages hold blocks ``spans`` (a (first, last) per stage):
        some stage of the rank lacks its first or last block, or holds the block before or after."""
        final, differs = len(self.problem.block_time_s) - 1, []
        for s, (first, last) in zip(self.problem.rank_stages(rank), spans):
            differs += [self.x[first][s].Not(), self.x[last][s].Not()]
            differs += [self.x[first - 1][s]] if first > 0 else []
            differs += [self.x[last + 1][s]] if last < final else []
        self.model.add_bool_or(differs)

    def owner_bound(self, rank: int, name: str) -> None:
        """Where the rank holds ``name`` under ZeRO-1, its replica owning it holds all of the
        parameter's owned state, not its share: the rank's memory with its shares replaced by
        that must fit too (a bound the owner's exact figure, `cut_problem.owner_excess`, never falls below)."""
        p = self.problem
        stages = p.rank_stages(rank)
        shares = sum(self.stage_state(s, self.shares) for s in stages)
        owned = p.owned_state[name][0] * self._held(name, stages, f"rank{rank}")
        for memory in self.rank_memory(rank):
            self.model.add(memory - shares + owned <= p.memory_limit_bytes)

    def stage_activations(self, s: int) -> cp_model.LinearExpr:
        """Bytes that stage ``s`` saves for backward per microbatch."""
        return sum(nbytes * self.x[k][s] for k, nbytes in enumerate(self.problem.block_activation_bytes) if nbytes)

    def rank_memory(self, rank: int) -> list[cp_model.LinearExpr]:
        """The rank's bytes at each moment that may be its peak (one where the rank holds one stage)."""
        p, m = self.problem, self.model
        stages = p.rank_stages(rank)
        moments = p.moments(rank)
        state = sum(self.stage_state(s) for s in stages) + p.overhead_bytes + self.rank_rebuilt(rank) + self.rank_seeds(rank)
        if rank == p.rank_of(p.stages - 1):
            state += p.loss_working_bytes
        if len(moments) == 1:
            return [state + sum(count * self.stage_activations(s) for count, s in zip(moments[0], stages))]
        # several moments: each stage's bytes per microbatch once, as a variable the moments share
        bound = sum(p.block_activation_bytes)
        per_stage = []
        for s in stages:
            nbytes = m.new_int_var(0, bound, f"stage{s}_activation_bytes")
            m.add(nbytes == self.stage_activations(s))
            per_stage.append(nbytes)
        return [state + sum(count * nbytes for count, nbytes in zip(held, per_stage)) for held in moments]

    def rank_seeds(self, rank: int) -> cp_model.IntVar | int:
        """The weight-gradient seeds the rank's stages keep under a split backward, as one variable
        that its moments share (each asks it: the owners' bounds too)."""
        p = self.problem
        if rank not in self._seeds:
            terms = [p.weight_seeds_at_once[s] * nbytes * self.x[k][s] for s in p.rank_stages(rank)
                     if p.block_weight_seed_bytes and p.weight_seeds_at_once[s]
                     for k, nbytes in enumerate(p.block_weight_seed_bytes) if nbytes]
            self._seeds[rank] = 0
            if terms:
                bound = max(p.weight_seeds_at_once) * sum(p.block_weight_seed_bytes)
                self._seeds[rank] = self.model.new_int_var(0, bound, f"rank{rank}_seed_bytes")
                self.model.add(self._seeds[rank] == sum(terms))
        return self._seeds[rank]

    def rank_rebuilt(self, rank: int) -> cp_model.LinearExpr | int:
        """The bytes that the recompute of one of the rank's stages rebuilds in backward: the
        largest of its stages' (one stage's backward runs at a time)."""
        p, m = self.problem, self.model
        if not p.block_rebuilt_bytes:
            return 0
        per_stage = [p.rebuilt_at_once[s] * sum(nbytes * self.x[k][s] for k, nbytes in enumerate(p.block_rebuilt_bytes)
                                                if nbytes) for s in p.rank_stages(rank)]
        if len(per_stage) == 1:
            return per_stage[0]
        largest = m.new_int_var(0, max(p.rebuilt_at_once) * sum(p.block_rebuilt_bytes), f"rank{rank}_rebuilt_bytes")
        for nbytes in per_stage:
            m.add(largest >= nbytes)
        return largest

    def hint(self, cuts: tuple[int, ...]) -> None:
        """Start the search from ``cuts``: on long chains (a 7B model has hundreds of blocks) CP-SAT
        can otherwise spend its whole time limit before it finds any plan."""
        blocks = len(self.problem.block_time_s)
        for s, members in enumerate(stage_ranges(cuts, blocks)):
            for k in range(blocks):
                self.model.add_hint(self.x[k][s], k in members)
        for k in range(blocks - 1):
            for s in range(self.problem.stages - 1):
                self.model.add_hint(self.end[k][s], cuts[s] == k)

    def cuts(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        blocks = len(self.problem.block_time_s)
        return tuple(
            next(k for k in range(blocks - 1) if solver.value(self.end[k][s])) for s in range(self.problem.stages - 1)
        )


def _solve(model: cp_model.CpModel, time_limit_s: float) -> tuple[cp_model.CpSolver, int]:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 2
    status = solver.solve(model)
    return solver, status


def solve_cuts(problem: PipelineProblem, *, time_limit_s: float = 30.0, hint: tuple[int, ...] | None = None) -> CutSolution:
    """The cuts that minimise the pipeline latency within the memory limit; the search starts
    from ``hint`` (by default, cuts that balance the stages' compute).

    What a ZeRO-1 rank's replica owning most holds beyond its shares depends on which whole
    tensors the rank holds (`cut_problem.owner_excess`), which no linear term says. CP-SAT solves
    without it; where its cuts break a rank's limit by it, that rank's largest tensor's
    `owner_bound` is added, or where that bound is in already, the rank's stages' spans are ruled
    out (a rank's memory depends on its own spans alone), and CP-SAT solves again, each round
    within ``time_limit_s``, all of them within `_OWNER_ROUNDS_LIMIT` times it. Both rule out
    only cuts that do not fit, so every round's bound and optimality hold for the problem; where
    the time runs out first, the starting cuts are taken if they fit."""
    if problem.stages == 1:
        evaluation = evaluate(problem, ())
        _check_memory(problem, evaluation)
        return CutSolution(evaluation=evaluation, status="optimal", bound_s=evaluation.objective_s, gap=0.0)
    start = _start(problem, hint)
    start_fits = max(start.rank_memory_bytes) <= problem.memory_limit_bytes
    bounds: set[tuple[int, str]] = set()
    ruled_out: set[tuple[int, tuple[tuple[int, int], ...]]] = set()  # (rank, its stages' spans)
    deadline, bound = time.monotonic() + _OWNER_ROUNDS_LIMIT * time_limit_s, 0.0
    while True:
        round_s = max(min(time_limit_s, deadline - time.monotonic()), _LEAST_ROUND_S)
        evaluation, status, round_bound = _solved(problem, start, start_fits, bounds, ruled_out, round_s,
                                                  time_limit_s=time_limit_s)
        bound = max(bound, round_bound)
        over = [r for r, nbytes in enumerate(evaluation.rank_memory_bytes) if nbytes > problem.memory_limit_bytes]
        largest = largest_owned(problem, evaluation.cuts)
        if not over or any(largest[r] is None for r in over):
            break  # fits, or breaks the limit by more than the owners (_check_memory says so)
        spans = stage_ranges(evaluation.cuts, len(problem.block_time_s))
        for r in over:
            if (r, largest[r]) not in bounds:
                bounds.add((r, largest[r]))
            else:
                ruled_out.add((r, tuple((spans[s][0], spans[s][-1]) for s in problem.rank_stages(r))))
        if time.monotonic() >= deadline:
            if not start_fits:
                raise InfeasibleError(fitting.no_fit_message(problem, time_limit_s,
                                                             upper_bytes=max(start.rank_memory_bytes)))
            evaluation, status = start, cp_model.FEASIBLE
            break
    _check_memory(problem, evaluation)
    bound = min(bound, evaluation.objective_s)
    objective = evaluation.objective_s
    return CutSolution(
        evaluation=evaluation,
        status="optimal" if status == cp_model.OPTIMAL else "feasible",
        bound_s=bound,
        gap=0.0 if objective == 0 else max(0.0, (objective - bound) / objective),
    )


_OWNER_ROUNDS_LIMIT = 4  # `solve_cuts`'s rounds for ZeRO-1's owners, in all, in times its time limit
_LEAST_ROUND_S = 1.0  # a round near that deadline still gets this long


def _solved(problem: PipelineProblem, start: CutEvaluation, start_fits: bool, bounds: set[tuple[int, str]],
            ruled_out: set[tuple[int, tuple[tuple[int, int], ...]]], round_s: float, *,
            time_limit_s: float) -> tuple[CutEvaluation, int, float]:
    """CP-SAT's cuts within ``round_s``, with the `owner_bound` of each (rank, parameter) of
    ``bounds`` and no rank on the spans ``ruled_out`` for it, evaluated, or ``start`` where it
    fits and is faster; with CP-SAT's status and bound (seconds). ``time_limit_s``: the user's, as
    the errors say it."""
    cut_model = _CutModel(problem)
    m = cut_model.model
    horizon = round(sum(problem.block_time_s) * _NS + 2 * sum(problem.boundary_transfer_s) * _NS) + 1
    slowest = m.new_int_var(0, horizon, "slowest_stage_time")
    times = [cut_model.stage_time(s) for s in range(problem.stages)]
    for stage_time in times:
        m.add(slowest >= stage_time)
    for rank in range(problem.ranks):
        for memory in cut_model.rank_memory(rank):
            m.add(memory <= problem.memory_limit_bytes)
    for rank, name in sorted(bounds):
        cut_model.owner_bound(rank, name)
    for rank, spans in sorted(ruled_out):
        cut_model.rule_out(rank, spans)
    m.minimize(sum(times) + (problem.microbatches - 1) * slowest)
    cut_model.hint(start.cuts)
    solver, status = _solve(m, round_s)
    if status == cp_model.INFEASIBLE:
        raise InfeasibleError(_owners_message(problem, bounds) if bounds else _infeasible_message(problem, time_limit_s))
    bound = max(0.0, solver.best_objective_bound / _NS)
    # On long chains CP-SAT may stop with no plan or a poor one, hint or not: the starting
    # cuts, when they fit in memory, are then the answer, and CP-SAT's bound still says how good.
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if not start_fits:
            raise InfeasibleError(fitting.no_fit_message(problem, time_limit_s, upper_bytes=max(start.rank_memory_bytes)))
        return start, status, bound
    evaluation = evaluate(problem, cut_model.cuts(solver))
    # The solution is re-checked in plain Python: the CP-SAT model and evaluate() must agree up to
    # the rounding of each block's time to whole nanoseconds. A solution found before the time
    # limit, not proven optimal, may hold the slowest-stage variable above its slowest stage, so
    # its objective may exceed the cuts' own; never fall below it.
    rounding = (len(problem.block_time_s) + 2 * problem.stages) * problem.microbatches
    excess = solver.objective_value - evaluation.objective_s * _NS
    assert -rounding <= excess and (status != cp_model.OPTIMAL or excess <= rounding), (evaluation, excess)
    if start_fits and start.objective_s < evaluation.objective_s:
        evaluation = start
    return evaluation, status, bound


def _start(problem: PipelineProblem, hint: tuple[int, ...] | None) -> CutEvaluation:
    """Where CP-SAT starts, and what it must beat: of ``hint`` (by default, cuts that balance the
    stages' compute), the search's cutter's cuts and, where neither fits, cuts that fit found
    without CP-SAT, the fastest that fit (the first where none does). A time-limited solve then
    never ends on cuts worse than those."""
    given = evaluate(problem, hint if hint is not None else _balanced_cuts(problem))
    found = [given]
    cutter = fitting.cutter_cuts(problem)
    if cutter is not None:
        found.append(evaluate(problem, cutter))
    limit = problem.memory_limit_bytes
    if all(max(e.rank_memory_bytes) > limit for e in found):
        fitting_start = fitting.fitting_cuts(problem)
        if fitting_start is not None:
            found.append(evaluate(problem, fitting_start))
    fit = [e for e in found if max(e.rank_memory_bytes) <= limit]
    return min(fit, key=lambda e: e.objective_s) if fit else given


def _balanced_cuts(problem: PipelineProblem) -> tuple[int, ...]:
    """Cuts that give each stage about an equal share of the compute time, one block at least."""
    blocks, stages = len(problem.block_time_s), problem.stages
    total = sum(problem.block_time_s) or 1.0
    cuts: list[int] = []
    elapsed = 0.0
    for k in range(blocks - 1):
        elapsed += problem.block_time_s[k]
        room = blocks - 1 - k  # blocks left after k: each later stage needs one
        due = len(cuts) < stages - 1 and (elapsed >= total * (len(cuts) + 1) / stages or room <= stages - 1 - len(cuts))
        if due and (not cuts or k > cuts[-1]):
            cuts.append(k)
    return tuple(cuts)


def _check_memory(problem: PipelineProblem, evaluation: CutEvaluation) -> None:
    worst = max(evaluation.rank_memory_bytes)
    if worst > problem.memory_limit_bytes:
        if problem.stages == 1:
            raise InfeasibleError(_infeasible_message(problem, 10.0))
        raise AssertionError("the solver returned cuts that break the memory limit")


def _smallest_peak_memory(problem: PipelineProblem, time_limit_s: float) -> int:
    if problem.stages == 1:
        return evaluate(problem, ()).rank_memory_bytes[0]
    cut_model = _CutModel(problem)
    m = cut_model.model
    everything = (
        sum(problem.held_bytes.values())
        + max(problem.in_flight) * sum(problem.block_activation_bytes)
        + problem.overhead_bytes * problem.ranks
        + max(problem.rebuilt_at_once, default=0) * sum(problem.block_rebuilt_bytes) * problem.ranks
        + sum(nbytes * len(readers) for _, _, extra in problem.split_layers for nbytes, readers in extra)
        + problem.loss_working_bytes
        + max(problem.weight_seeds_at_once, default=0) * sum(problem.block_weight_seed_bytes)
    )
    peak = m.new_int_var(0, everything, "peak_memory")
    for rank in range(problem.ranks):
        for memory in cut_model.rank_memory(rank):
            m.add(peak >= memory)
    m.minimize(peak)
    solver, status = _solve(m, time_limit_s)
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    return round(solver.objective_value)


def _owners_message(problem: PipelineProblem, bounds: set[tuple[int, str]]) -> str:
    """Why no cuts fit once ZeRO-1's owners of whole tensors are counted (`solve_cuts`)."""
    name = max((name for _, name in bounds), key=lambda n: problem.owned_state[n][0])
    owned, limit = gib_beside(problem.owned_state[name][0], problem.memory_limit_bytes)
    return (
        f"the model does not fit: with {problem.stages} pipeline stages and {problem.microbatches} microbatches, "
        f"ZeRO-1 leaves the optimizer state of each tensor whole to one replica ({owned} GiB for {name}), and no "
        f"cuts keep the fullest device within {limit} GiB; use --zero 2 or 3 (which shard every tensor), more "
        "stages (--pp), or raise --memory"
    )


def _infeasible_message(problem: PipelineProblem, time_limit_s: float) -> str:
    need, limit = gib_beside(_smallest_peak_memory(problem, time_limit_s), problem.memory_limit_bytes)
    return (
        f"the model does not fit: with {problem.stages} pipeline stages and {problem.microbatches} microbatches "
        f"the fullest device needs {need} GiB but the memory limit is {limit} GiB; raise --memory to at least {need} "
        "or use more stages (--pp)"
    )
