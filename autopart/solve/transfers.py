"""The search's time of each pipeline boundary's messages, by the rule the runtime sends them by
(`autopart.ir.scatter_gather`) and the plan's step model times them (`autopart.predict.messages`):
each tensor-parallel rank sends its share over the pipeline link (its slice of a
sequence-parallel tensor, its 1/t of a replicated one that splits, else all of it), and the
receivers all-gather the replicated tensors sent in parts over the group's own links. Timing a
replicated tensor whole over the pipeline link instead charged a TP layout without sequence
parallelism up to t times the transfer its plan then predicts."""

from __future__ import annotations

from autopart.solve.chain_costs import ChainCosts
from cost_models.comm import nodes_spanned

__all__ = ["boundary_transfer_s"]


def boundary_transfer_s(costs: ChainCosts, layout, cluster) -> tuple[float, ...]:
    """Per block boundary of ``costs`` (cut at ``layout``'s tensor-parallel degree), the seconds
    from the send of what crosses it to its arrival on every receiving rank."""
    gathered = costs.boundary_gathered_bytes or (0,) * len(costs.boundary_bytes)
    pairs = tuple(zip(costs.boundary_bytes, gathered, strict=True))
    times = {pair: _transfer_s(*pair, layout, cluster) for pair in set(pairs)}  # a chain repeats a few sizes
    return tuple(times[pair] for pair in pairs)


def _transfer_s(held: int, whole: int, layout, cluster) -> float:
    across = layout.pipeline_crosses_nodes(cluster.gpus_per_node)
    if not whole:
        return cluster.p2p_s(held, across)
    tp_nodes = nodes_spanned(layout.tp, 1, cluster.gpus_per_node, layout.world_size)
    return cluster.p2p_s(held - whole + whole // layout.tp, across) + cluster.all_gather_s(whole, layout.tp, tp_nodes)
