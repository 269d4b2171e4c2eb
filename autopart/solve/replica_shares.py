"""What each pipeline rank holds of a layout's chain, and how ZeRO-1's data-parallel replicas
share it. Each replica owns whole tensors (`autopart.ir.owners`, in the optimizer's groups), so
the replica owning most holds more than an even share of the optimizer state
(`owners_beyond_shares`, as `autopart.predict.memory.owner_excess_bytes` counts it) and steps more
than an even share of the parameters (`slowest_replica_bytes`), while FSDP (ZeRO-2 and 3) shards
every tensor evenly. The compiled plan's step (`autopart.predict.step_time.rank_tails`) picks the
slowest replica by its optimizer time; the search by its bytes, at the cluster's rate per byte.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable

from autopart.ir.owners import largest_share
from autopart.predict.memory import optimizer_group, optimizer_groups, owner_excess_bytes
from autopart.solve.chain_costs import ChainCosts

__all__ = ["owners_beyond_shares", "parameter_bytes_per_rank", "rank_spans", "slowest_replica_bytes", "trained_bytes"]


def rank_spans(cuts: tuple[int, ...], blocks: int, ranks: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """Per rank, the (first, last) blocks of each of its stages, in stage order."""
    firsts, lasts = [0, *(c + 1 for c in cuts)], [*cuts, blocks - 1]
    held: list[list[tuple[int, int]]] = [[] for _ in range(max(ranks) + 1)]
    for s, span in enumerate(zip(firsts, lasts)):
        held[ranks[s]].append(span)
    return [tuple(spans) for spans in held]


def parameter_bytes_per_rank(table, layout, cut, ranks: tuple[int, ...]) -> list[int]:
    """Per rank, the bytes of the parameters its stages read (a tied weight once per rank)."""
    costs = table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
    return [sum(costs.parameter_bytes[p] for p in _read_by(costs, spans))
            for spans in rank_spans(cut.cuts, len(costs), ranks)]


def trained_bytes(costs: ChainCosts, spans: tuple[tuple[int, int], ...]) -> int:
    """Of the parameters that blocks ``spans`` read (each once), the bytes that train: what a rank
    holding them reduces over its data-parallel group and steps. All of them where nothing is
    frozen; a fine-tune's frozen base has no gradient."""
    return sum(costs.parameter_bytes[p] for p in _read_by(costs, spans) if p not in costs.frozen_parameters)


def _read_by(costs: ChainCosts, spans: tuple[tuple[int, int], ...]) -> set[str]:
    """The parameters that blocks ``spans`` read, each once."""
    return {p for first, last in spans for k in range(first, last + 1) for p in costs.block_parameters[k]}


def owners_beyond_shares(table, layout, costs: ChainCosts) -> Callable[[tuple[tuple[int, int], ...]], int] | None:
    """Of a rank whose stages hold blocks ``spans`` (a (first, last) per stage): what its ZeRO-1
    replica owning most holds beyond its shares (`autopart.predict.memory.owner_excess_bytes`),
    which no running sum of the cutter says. None where ZeRO-1 gives no replica whole tensors."""
    if int(layout.zero) != 1 or layout.dp == 1:
        return None
    owned = functools.cache(lambda nbytes, frozen: table.owned_bytes(nbytes, dp=layout.dp, zero=1, dtype=layout.dtype,
                                                                      frozen=frozen))
    frozen = costs.frozen_parameters

    @functools.cache
    def excess(spans: tuple[tuple[int, int], ...]) -> int:
        groups = _rank_groups(layout, costs, spans)
        return owner_excess_bytes([[owned(costs.parameter_bytes[n], n in frozen) for n in group] for group in groups],
                                  layout.dp)

    return excess


def slowest_replica_bytes(layout, costs: ChainCosts) -> Callable[[tuple[tuple[int, int], ...]], int] | None:
    """Of a rank whose stages hold blocks ``spans``: the parameter bytes that its ZeRO-1 replica
    owning most steps. Each replica steps whole tensors and the step ends once the slowest has
    shared its weights (`autopart.predict.step_time.rank_tails`, which takes the slowest by its
    optimizer time where this takes the most bytes). None where no replica owns whole tensors.

    The search asks it of every rank of every cut it judges; what the owners take depends only on
    how many tensors of each size each optimizer group holds, so ranks holding alike blocks (the
    repeated layers) share one answer."""
    if int(layout.zero) != 1 or layout.dp == 1:
        return None
    shared, frozen = costs.shared_parameters, costs.frozen_parameters  # a frozen one is not stepped

    def sized(names) -> tuple[tuple[int, int], ...]:  # (group, bytes), of each name once
        return tuple(sorted((optimizer_group(layout.dtype, p in costs.decayed_parameters), costs.parameter_bytes[p])
                            for p in dict.fromkeys(names)))

    kinds: dict[tuple[tuple[int, int], ...], int] = {}
    kind = [kinds.setdefault(sized(p for p in names if p not in shared and p not in frozen), len(kinds))
            for names in costs.block_parameters]
    sizes = list(kinds)
    tied = [tuple(dict.fromkeys(p for p in names if p in shared and p not in frozen))
            for names in costs.block_parameters]

    @functools.cache
    def share(held: tuple[tuple[int, int], ...], ties: tuple[tuple[int, int], ...]) -> int:
        groups: dict[int, list[int]] = {}
        for group, nbytes in [pair for k, count in held for pair in sizes[k] * count] + list(ties):
            groups.setdefault(group, []).append(nbytes)
        return largest_share([groups[g] for g in sorted(groups)], layout.dp)

    @functools.cache
    def stepped(spans: tuple[tuple[int, int], ...]) -> int:
        held = collections.Counter(kind[k] for first, last in spans for k in range(first, last + 1))
        # a weight two of the rank's stages read is in both stages' modules: once per stage
        ties = tuple(sorted(pair for first, last in spans
                            for pair in sized(p for k in range(first, last + 1) for p in tied[k])))
        return share(tuple(sorted(held.items())), ties)

    return stepped


def _rank_groups(layout, costs: ChainCosts, spans: tuple[tuple[int, int], ...]) -> list[list[str]]:
    """The parameters of a rank holding blocks ``spans``, in the optimizer groups that ZeRO-1
    partitions in turn (a weight two of the rank's stages read is in both stages' modules)."""
    names = [p for first, last in spans
             for p in dict.fromkeys(p for k in range(first, last + 1) for p in costs.block_parameters[k])]
    return optimizer_groups(names, dtype=layout.dtype, decayed=costs.decayed_parameters)
