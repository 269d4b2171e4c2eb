"""The pipeline cut problem and its figures computed in plain Python.

A chain of blocks is cut into ``stages`` contiguous stages; ``evaluate(problem, cuts)`` gives
each stage's time per microbatch, each rank's memory and the pipeline latency that
`autopart.solve.pipeline` minimises with CP-SAT (see its docstring for the model). Plain Python,
so that CP-SAT's solutions, the fitting heuristics (`autopart.solve.fitting`) and the tests'
exhaustive enumeration all check cuts with the same figures.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

from autopart.ir.errors import ConfigError
from autopart.predict.memory import owner_excess_bytes

__all__ = ["PipelineProblem", "CutEvaluation", "CutSolution", "evaluate", "largest_owned", "owner_excess", "stage_ranges"]


@dataclass(frozen=True, kw_only=True)
class PipelineProblem:
    """A chain of blocks to cut into stages. Times in seconds, memory in bytes."""

    block_time_s: tuple[float, ...]  # forward + backward of one microbatch
    block_activation_bytes: tuple[int, ...]  # saved for backward, one microbatch
    boundary_transfer_s: tuple[float, ...]  # one way, one microbatch; len = blocks - 1
    # per boundary, whether a gradient comes back across it (`autopart.solve.chain_costs.ChainCosts.boundary_gradients`);
    # () where one comes back across every boundary
    boundary_gradients: tuple[bool, ...] = ()
    parameter_state_bytes: dict[str, int]  # parameter -> bytes of weights, gradients, optimizer state
    block_parameters: tuple[tuple[str, ...], ...]  # per block, the parameters it reads
    stages: int
    microbatches: int
    in_flight: tuple[int, ...]  # per stage: microbatches whose activations are held at once
    memory_limit_bytes: int
    overhead_bytes: int = 0  # per rank
    stage_rank: tuple[int, ...] = ()  # rank that holds each stage; empty: stage s on rank s
    # Per rank, the moments that may be its peak: at each, per stage of the rank (in stage order),
    # the microbatches held (`autopart.predict.in_flight.rank_in_flight`). Empty: every stage at its
    # own peak at once, which is exact where a rank holds one stage and an upper bound elsewhere.
    rank_in_flight: tuple[tuple[tuple[int, ...], ...], ...] = ()
    # Per repeated layer whose parameters are its own FSDP unit (ZeRO-3): (first block, end block,
    # (bytes, the blocks that read them) per set of its parameters that the same blocks read). A
    # cut inside the layer writes its halves inline in the two stages, whose root units then hold
    # those parameters: each stage that reads one pays its bytes more (whole weights and gradients
    # beside the shards).
    split_layers: tuple[tuple[int, int, tuple[tuple[int, tuple[int, ...]], ...]], ...] = ()
    # Per block, the bytes its stage's recompute rebuilds in backward (full: every activation the
    # block would have kept), and per stage, how many microbatches' rebuilt bytes live at once
    # (`autopart.predict.in_flight.transient`); a rank holds the largest of its stages'. Empty:
    # no recompute.
    block_rebuilt_bytes: tuple[int, ...] = ()
    rebuilt_at_once: tuple[int, ...] = ()
    # what the loss's backward holds besides, on the rank of the last stage (`autopart.passes.front.loss_working_bytes`)
    loss_working_bytes: int = 0
    # Per block, what a split backward's I keeps for its W (`autopart.passes.weight_seeds`), and per
    # stage, how many microbatches' seeds live at once (`autopart.predict.in_flight.weight_pending`);
    # a rank holds its stages' together. Empty: the backward is whole.
    block_weight_seed_bytes: tuple[int, ...] = ()
    weight_seeds_at_once: tuple[int, ...] = ()
    # ZeRO-1 (`autopart.predict.memory.owner_excess_bytes`): per parameter, the bytes of its state
    # that one data-parallel replica owns whole and its optimizer parameter group, and the replicas;
    # a rank holds what its replica owning most owns, beyond the 1/dp shares in parameter_state_bytes
    owned_state: dict[str, tuple[int, int]] = field(default_factory=dict)
    replicas: int = 1
    # per buffer, what a stage that reads it holds for it (`autopart.predict.memory.held_buffer_bytes`),
    # and per block, the buffers it reads; each stage holds its blocks' buffers, as its parameters
    buffer_bytes: dict[str, int] = field(default_factory=dict)
    block_buffers: tuple[tuple[str, ...], ...] = ()

    @functools.cached_property
    def held_bytes(self) -> dict[str, int]:
        """Per parameter its state, per buffer its held bytes: what a stage holds for each tensor it reads."""
        return {**self.parameter_state_bytes, **self.buffer_bytes}

    @functools.cached_property
    def block_held(self) -> tuple[tuple[str, ...], ...]:
        """Per block, the parameters and buffers it reads (``held_bytes``' keys)."""
        if not self.block_buffers:
            return self.block_parameters
        return tuple((*p, *b) for p, b in zip(self.block_parameters, self.block_buffers))

    @property
    def ranks(self) -> int:
        return max(self.rank_of(s) for s in range(self.stages)) + 1

    def rank_of(self, stage: int) -> int:
        return self.stage_rank[stage] if self.stage_rank else stage

    def rank_stages(self, rank: int) -> list[int]:
        return self._stages_by_rank[rank]

    @functools.cached_property
    def gradient_transfer_s(self) -> tuple[float, ...]:
        """Per boundary, the seconds of the gradient message back across it: ``boundary_transfer_s``,
        or none where no gradient comes back (``boundary_gradients``)."""
        if not self.boundary_gradients:
            return self.boundary_transfer_s
        return tuple(t if back else 0.0 for t, back in zip(self.boundary_transfer_s, self.boundary_gradients, strict=True))

    @functools.cached_property
    def _stages_by_rank(self) -> list[list[int]]:
        found: list[list[int]] = [[] for _ in range(self.ranks)]
        for s in range(self.stages):
            found[self.rank_of(s)].append(s)
        return found

    def moments(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """The rank's moments that may be its peak: per stage of the rank, the microbatches held."""
        if self.rank_in_flight:
            return self.rank_in_flight[rank]
        return (tuple(self.in_flight[s] for s in self.rank_stages(rank)),)

    def __post_init__(self) -> None:
        blocks = len(self.block_time_s)
        if self.stages > blocks:
            raise ConfigError(
                f"the model has {blocks} places where a pipeline stage can start but {self.stages} stages were asked "
                f"for; use --pp {blocks} or fewer"
            )
        assert len(self.boundary_transfer_s) == blocks - 1
        assert len(self.boundary_gradients) in (0, blocks - 1)
        assert len(self.in_flight) == self.stages
        assert len(self.block_parameters) == blocks == len(self.block_activation_bytes)
        assert len(self.block_buffers) in (0, blocks) and self.parameter_state_bytes.keys().isdisjoint(self.buffer_bytes)
        assert len(self.block_rebuilt_bytes) in (0, blocks) and len(self.rebuilt_at_once) == (
            self.stages if self.block_rebuilt_bytes else 0)
        assert len(self.block_weight_seed_bytes) in (0, blocks) and len(self.weight_seeds_at_once) == (
            self.stages if self.block_weight_seed_bytes else 0)
        if self.rank_in_flight:  # each stage's own peak is the most it holds at any of its rank's moments
            for rank, moments in enumerate(self.rank_in_flight):
                assert all(len(held) == len(self.rank_stages(rank)) for held in moments)
                assert [max(column) for column in zip(*moments)] == [self.in_flight[s] for s in self.rank_stages(rank)]


@dataclass(frozen=True, kw_only=True)
class CutEvaluation:
    cuts: tuple[int, ...]  # stage s ends after block cuts[s]; len = stages - 1
    stage_time_s: tuple[float, ...]
    rank_memory_bytes: tuple[int, ...]
    objective_s: float


@dataclass(frozen=True, kw_only=True)
class CutSolution:
    evaluation: CutEvaluation
    status: str  # "optimal" or "feasible"
    bound_s: float
    gap: float


def stage_ranges(cuts: tuple[int, ...], blocks: int) -> list[range]:
    starts = [0, *(c + 1 for c in cuts)]
    ends = [*(c + 1 for c in cuts), blocks]
    return [range(a, b) for a, b in zip(starts, ends)]


def evaluate(problem: PipelineProblem, cuts: tuple[int, ...]) -> CutEvaluation:
    blocks = len(problem.block_time_s)
    times: list[float] = []
    memory = [problem.overhead_bytes] * problem.ranks
    activations = []  # per stage, one microbatch's
    ranges = stage_ranges(cuts, blocks)
    for s, members in enumerate(ranges):
        time = sum(problem.block_time_s[k] for k in members)
        if s > 0:  # the gradient it sends back
            time += problem.gradient_transfer_s[cuts[s - 1]]
        if s < problem.stages - 1:
            time += problem.boundary_transfer_s[cuts[s]]
        held = {p for k in members for p in problem.block_held[k]}
        activations.append(sum(problem.block_activation_bytes[k] for k in members))
        memory[problem.rank_of(s)] += sum(problem.held_bytes[p] for p in held)
        times.append(time)
    for rank, excess in enumerate(owner_excess(problem, cuts)):
        memory[rank] += excess
    for first, end, extra in problem.split_layers:
        if any(first <= c < end - 1 for c in cuts):
            for s, members in enumerate(ranges):
                memory[problem.rank_of(s)] += sum(nbytes for nbytes, readers in extra
                                                  if any(k in members for k in readers))
    memory[problem.rank_of(problem.stages - 1)] += problem.loss_working_bytes
    if problem.block_weight_seed_bytes:
        for s, members in enumerate(ranges):
            memory[problem.rank_of(s)] += problem.weight_seeds_at_once[s] * sum(problem.block_weight_seed_bytes[k]
                                                                                for k in members)
    for rank in range(problem.ranks):
        mine = [activations[s] for s in problem.rank_stages(rank)]
        memory[rank] += max(sum(count * nbytes for count, nbytes in zip(held, mine)) for held in problem.moments(rank))
        if problem.block_rebuilt_bytes:
            memory[rank] += max(problem.rebuilt_at_once[s] * sum(problem.block_rebuilt_bytes[k] for k in ranges[s])
                                for s in problem.rank_stages(rank))
    objective = sum(times) + (problem.microbatches - 1) * max(times)
    return CutEvaluation(
        cuts=tuple(cuts), stage_time_s=tuple(times), rank_memory_bytes=tuple(memory), objective_s=objective
    )


def owner_excess(problem: PipelineProblem, cuts: tuple[int, ...]) -> list[int]:
    """Per rank, what its ZeRO-1 replica owning most holds beyond the shares of its stages'
    parameters (`PipelineProblem.owned_state`)."""
    return [owner_excess_bytes(_groups(problem, names), problem.replicas) for names in _rank_owned(problem, cuts)]


def largest_owned(problem: PipelineProblem, cuts: tuple[int, ...]) -> list[str | None]:
    """Per rank, the parameter of the largest owned state it holds; None where it holds none."""
    return [max(names, key=lambda n: problem.owned_state[n][0], default=None) for names in _rank_owned(problem, cuts)]


def _rank_owned(problem: PipelineProblem, cuts: tuple[int, ...]) -> list[list[str]]:
    """Per rank, the parameters with owned state in its optimizer: a parameter two stages of a
    rank read is in both stages' modules, so twice."""
    held: list[list[str]] = [[] for _ in range(problem.ranks)]
    if not problem.owned_state:
        return held
    for s, members in enumerate(stage_ranges(cuts, len(problem.block_time_s))):
        stage = dict.fromkeys(p for k in members for p in problem.block_parameters[k])
        held[problem.rank_of(s)] += [name for name in stage if name in problem.owned_state]
    return held


def _groups(problem: PipelineProblem, names: Iterable[str]) -> list[list[int]]:
    """The owned bytes of ``names`` in their optimizer parameter groups, in the groups' order."""
    groups: dict[int, list[int]] = {}
    for name in names:
        size, group = problem.owned_state[name]
        groups.setdefault(group, []).append(size)
    return [groups[g] for g in sorted(groups)]
