"""One tensor-parallel rank's share of a block's weight-gradient seeds (`autopart.passes.weight_seeds`).

A seed is the gradient of an op's output, split as the output is: a t-th of a column-parallel
product's, a row-parallel product's partial sum whole (the gradient that reaches it is gathered
back, under sequence parallelism, from the reduce-scatter's slice), unless the product runs in
pieces with its reduce-scatter (``--tp-overlap``: its gradient is the slice). An op whose seeds
its one reader keeps too (a linear and its bias add) shares them where nothing between the two
makes a new gradient: the same placement, or a partial sum all-reduced (Megatron's g, whose
backward passes the gradient on as it is); a reduce-scatter's backward gathers a new one.

The linears run in pieces are the solver's (``BlockSharding.overlapped``); the plan leaves whole
those its code cannot cut (`autopart.solve.assemble._overlapped`: one reading what its stage
receives, or what another block made whole), none of which is a row-parallel product feeding a
reduce-scatter in a Transformer, whose cuts pass the residual stream alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx

from autopart.ir.placement import PARTIAL, REPLICATE
from autopart.solve.sharding import Strategy

__all__ = ["local_seed_bytes"]


def local_seed_bytes(costs: dict, fx_nodes: dict[str, fx.Node], block_nodes: Iterable[str],
                     chosen: dict[str, Strategy], overlapped: dict[str, int], t: int) -> int:
    """The seeds one rank keeps for the block's ops (``chosen``: the sharded ones' strategies;
    ``overlapped``: the linears run in pieces)."""
    total, inside = 0, set(block_nodes)
    for name in inside:
        cost = costs[name]
        if not cost.weight_seed_bytes or _shared(name, cost.weight_seed_reader, inside, chosen, fx_nodes):
            continue
        strategy = chosen.get(name)
        split = strategy is not None and strategy.divided and (strategy.output.kind == "S" or name in overlapped)
        total += cost.weight_seed_bytes // (t if split else 1)
    return total


def _shared(name: str, reader: str, inside: set[str], chosen: dict[str, Strategy], fx_nodes: dict[str, fx.Node]) -> bool:
    """Whether the seeds of ``name`` are its reader's, counted there: only within the block (a cut
    between the two would leave each stage its own), and through no collective that makes a new gradient."""
    if not reader or reader not in inside:
        return False
    if name not in chosen and reader not in chosen:  # both run as in one process
        return True
    if name not in chosen or reader not in chosen:
        return False
    made = chosen[name].output
    taken = chosen[reader].inputs[fx_nodes[reader].all_input_nodes.index(fx_nodes[name])]
    return taken == made or (made == PARTIAL and taken == REPLICATE)
