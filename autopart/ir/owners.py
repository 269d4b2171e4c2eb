"""Which data-parallel replica owns which whole parameter under ZeRO-1: the rule that the runtime
runs (`autopart.runtime.sharded_masters` and torch's ``ZeroRedundancyOptimizer``, whose rule this
is) and the memory model counts (`autopart.predict.memory.owner_excess_bytes`).

The optimizer's parameter groups are taken in order, each one's tensors largest first, each onto
the replica that owns the fewest elements so far (the lower replica on a tie). Whole tensors are
not an even split: a replica that owns a vocabulary table may own many times its 1/dp share.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["partition", "largest_share"]


def partition(groups: Sequence[Sequence[int]], replicas: int) -> list[list[int]]:
    """Per group, the owner of each of its ``sizes`` (elements, or bytes proportional to them)."""
    loads = [(0, r) for r in range(replicas)]  # a heap of (load, replica): the least loaded, lower replica first
    owners: list[list[int]] = []
    for sizes in groups:
        mine = [0] * len(sizes)
        for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: the earlier first among equals
            load, replica = heapq.heappop(loads)
            mine[index] = replica
            heapq.heappush(loads, (load + sizes[index], replica))
        owners.append(mine)
    return owners


def largest_share(groups: Sequence[Sequence[int]], replicas: int) -> int:
    """What the replica owning most owns, of ``groups`` partitioned as `partition` does."""
    loads = [0] * replicas
    for sizes, owners in zip(groups, partition(groups, replicas)):
        for size, owner in zip(sizes, owners):
            loads[owner] += size
    return max(loads, default=0)
