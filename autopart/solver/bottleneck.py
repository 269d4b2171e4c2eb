"""Cut a chain of blocks into pipeline stages fast: bisection on the slowest stage's time.

The whole-plan search (``autopart/search.py``) scores thousands of layouts (mesh shape,
micro-batch size, schedule, ...), and each needs its cuts. CP-SAT takes seconds per solve on
long chains; this takes milliseconds. For a bound ``T`` on every stage's time, cutting greedily
from the first block (each stage as long as it can be while its time is within ``T`` and its
rank's memory within the limit) finds a plan whenever any plan meets ``T``: a stage's time and
memory only grow as it takes more blocks, so a stage that ends later never leaves the next one
worse off. Bisection on ``T`` then gives the smallest slowest stage. Where the transfers at the
stages' ends are equal (a Transformer's residual stream) that is also the smallest
``sum T_s + (m - 1) max T_s``, the pipeline latency that ``autopart.solver.pipeline`` minimises
with CP-SAT, which the search still runs on its finalists.

Recompute is chosen per stage inside the cut: a stage takes the lightest recompute mode
("none", then "selective", then "full") that keeps its rank within memory, and pays its time.

``ChainCosts`` holds what this needs, per block; it is built from the annotated chain by
``autopart.search`` and knows nothing of devices.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

__all__ = ["RECOMPUTE_MODES", "ChainCosts", "StageCut", "cut_stages", "lower_bound_s", "stage_figures"]

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class ChainCosts:
    """One microbatch through each block on one rank, after tensor-parallel sharding."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]  # input and weight gradients together
    weight_s: tuple[float, ...]  # the weight-gradient part of backward_s
    saved_bytes: tuple[int, ...]  # kept for backward without recompute
    selective_saved_bytes: tuple[int, ...]  # kept under selective recompute
    selective_recompute_s: tuple[float, ...]  # forward work selective recompute repeats in backward
    boundary_bytes: tuple[int, ...]  # what crosses after block k (len = blocks - 1)
    input_bytes: int  # the batch inputs (token ids, targets) a stage may read, per microbatch
    parameter_bytes: dict[str, int]  # per parameter, its share on one rank of the tensor-parallel group
    parameter_state_bytes: dict[str, int]  # the same with gradients and optimizer state
    block_parameters: tuple[tuple[str, ...], ...]
    _prefix: dict = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.forward_s)

    def prefix(self, name: str) -> list[float]:
        """Running sums of a per-block figure: ``prefix(x)[j] = sum(x[:j])``."""
        if name not in self._prefix:
            if name == "owned_parameter_bytes":
                values = self._owned_parameter_bytes()
            elif name == "full_recompute_s":
                values = self.forward_s
            elif name == "compute_s":
                values = [f + b for f, b in zip(self.forward_s, self.backward_s)]
            else:
                values = getattr(self, name)
            self._prefix[name] = [0, *itertools.accumulate(values)]
        return self._prefix[name]

    def _owned_parameter_bytes(self) -> list[int]:
        """Each parameter counted at the first block that reads it."""
        owned = [0] * len(self)
        seen: set[str] = set()
        for k, names in enumerate(self.block_parameters):
            for p in names:
                if p not in seen:
                    seen.add(p)
                    owned[k] += self.parameter_state_bytes[p]
        return owned

    @property
    def shared_parameters(self) -> dict[str, tuple[int, ...]]:
        """Parameters read by more than one block (tied embeddings), with the blocks that read them."""
        if "shared" not in self._prefix:
            readers: dict[str, list[int]] = {}
            for k, names in enumerate(self.block_parameters):
                for p in names:
                    readers.setdefault(p, []).append(k)
            self._prefix["shared"] = {p: tuple(ks) for p, ks in readers.items() if len(ks) > 1}
        return self._prefix["shared"]


@dataclass(frozen=True, kw_only=True)
class StageCut:
    cuts: tuple[int, ...]  # stage s ends after block cuts[s]
    recompute: tuple[str, ...]  # per stage
    stage_time_s: tuple[float, ...]  # forward + backward (+ recompute) + transfers, one microbatch
    stage_weight_s: tuple[float, ...]
    stage_memory_bytes: tuple[int, ...]
    rank_memory_bytes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class _Stage:
    time_s: float
    weight_s: float
    memory_bytes: int


def stage_figures(
    costs: ChainCosts, first: int, last: int, *, mode: str, in_flight: int, transfer_in_s: float, transfer_out_s: float,
    transient: int = 1,
) -> _Stage:
    """Time and memory of the stage of blocks ``first..last`` under a recompute mode: the figures
    of ``autopart.recompute.recompute_cost``. Recompute keeps the stage's arguments (what it
    receives, and the batch inputs, counted whole) per microbatch in flight, and the activations
    it rebuilds live while ``transient`` microbatches' backwards run."""
    p = costs.prefix
    compute = p("compute_s")[last + 1] - p("compute_s")[first]
    saved_none = p("saved_bytes")[last + 1] - p("saved_bytes")[first]
    received = (costs.boundary_bytes[first - 1] if first > 0 else 0) + costs.input_bytes
    if mode == "none":
        extra, held = 0.0, in_flight * saved_none
    elif mode == "selective":
        extra = p("selective_recompute_s")[last + 1] - p("selective_recompute_s")[first]
        selective = p("selective_saved_bytes")[last + 1] - p("selective_saved_bytes")[first]
        held = in_flight * (received + selective) + transient * max(0, saved_none - selective)
    elif mode == "full":
        extra = p("full_recompute_s")[last + 1] - p("full_recompute_s")[first]
        held = in_flight * received + transient * saved_none
    else:
        raise ValueError(f"unknown recompute mode {mode!r}")
    parameters = p("owned_parameter_bytes")[last + 1] - p("owned_parameter_bytes")[first]
    for name, readers in costs.shared_parameters.items():
        first_reader = readers[0]
        if first_reader < first and any(first <= k <= last for k in readers):
            parameters += costs.parameter_state_bytes[name]
    weight = p("weight_s")[last + 1] - p("weight_s")[first]
    return _Stage(time_s=compute + extra + transfer_in_s + transfer_out_s, weight_s=weight,
                  memory_bytes=parameters + held)


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
) -> StageCut | None:
    """The cuts with the smallest slowest stage that fit in memory, or None if nothing fits.
    With ``fit_only``, any cuts that fit (the question is whether some do).

    ``transfer_s[k]``: one-way seconds of what crosses after block k. ``modes``: per stage, the
    recompute modes allowed (all three by default). A rank holding several stages (interleaved)
    gives each an equal share of its memory while cutting; the result's memory is exact.
    ``transient``: per stage, the microbatches whose recomputed activations live at once (1 each
    by default; more where a zero-bubble W waits).
    """
    blocks = len(costs)
    if stages > blocks:
        return None
    modes = modes or (RECOMPUTE_MODES,) * stages
    ranks = max(stage_rank) + 1
    per_rank = [stage_rank.count(r) for r in range(ranks)]
    budget = [(memory_limit_bytes - overhead_bytes) // per_rank[stage_rank[s]] for s in range(stages)]
    if min(budget) <= 0:
        return None

    def stage(s: int, first: int, last: int, mode: str) -> _Stage:
        return stage_figures(
            costs, first, last, mode=mode, in_flight=in_flight[s],
            transfer_in_s=transfer_s[first - 1] if s > 0 else 0.0,
            transfer_out_s=transfer_s[last] if s < stages - 1 else 0.0,
            transient=transient[s] if transient else 1,
        )  # fmt: skip

    def fits(s: int, first: int, last: int, bound: float) -> str | None:
        for mode in modes[s]:
            figures = stage(s, first, last, mode)
            if figures.memory_bytes <= budget[s] and figures.time_s <= bound:
                return mode
        return None

    def greedy(bound: float) -> list[tuple[int, str]] | None:
        """Per stage (last block, mode), each stage as long as ``bound`` allows; None if none fits."""
        result = []
        first = 0
        for s in range(stages):
            latest = blocks - (stages - s)  # every later stage needs a block
            if s == stages - 1:
                mode = fits(s, first, blocks - 1, bound)
                if mode is None:
                    return None
                result.append((blocks - 1, mode))
                break
            if fits(s, first, first, bound) is None:
                return None
            # the last block this stage can end on: bisection (longer stages only cost more)
            lo, hi = first, latest
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if fits(s, first, mid, bound) is not None:
                    lo = mid
                else:
                    hi = mid - 1
            result.append((lo, fits(s, first, lo, bound)))
            first = lo + 1
        return result

    compute = costs.prefix("compute_s")
    worst_case = compute[-1] + sum(costs.forward_s) + 2 * sum(transfer_s) + 1e-9
    loose = greedy(worst_case)
    if loose is None or fit_only:
        return loose and _finish(costs, loose, stage, stage_rank, ranks, overhead_bytes, modes)
    largest_block = max(f + b for f, b in zip(costs.forward_s, costs.backward_s))
    lo, hi = max(largest_block, compute[-1] / stages) * (1 - 1e-9), worst_case
    while hi - lo > precision * hi:
        mid = (lo + hi) / 2
        if greedy(mid) is not None:
            hi = mid
        else:
            lo = mid
    chosen = greedy(hi)
    assert chosen is not None
    return _finish(costs, chosen, stage, stage_rank, ranks, overhead_bytes, modes)


def _finish(costs, chosen, stage, stage_rank, ranks, overhead_bytes, modes) -> StageCut:
    """The figures of the chosen cuts, each stage with the lightest recompute that fits its rank."""
    cuts = tuple(last for last, _ in chosen[:-1])
    firsts = [0, *(c + 1 for c in cuts)]
    figures = [stage(s, firsts[s], last, mode) for s, (last, mode) in enumerate(chosen)]
    rank_memory = [overhead_bytes] * ranks
    for s, f in enumerate(figures):
        rank_memory[stage_rank[s]] += f.memory_bytes
    return StageCut(
        cuts=cuts,
        recompute=tuple(mode for _, mode in chosen),
        stage_time_s=tuple(f.time_s for f in figures),
        stage_weight_s=tuple(f.weight_s for f in figures),
        stage_memory_bytes=tuple(f.memory_bytes for f in figures),
        rank_memory_bytes=tuple(rank_memory),
    )


def lower_bound_s(costs: ChainCosts, stages: int) -> float:
    """No cut makes the slowest stage faster than this."""
    compute = costs.prefix("compute_s")[-1]
    return max(compute / stages, max((f + b for f, b in zip(costs.forward_s, costs.backward_s)), default=0.0))

