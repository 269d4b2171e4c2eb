"""The search's time of each pipeline boundary's messages, by the rule the runtime sends them by
(`autopart.ir.scatter_gather`) and the plan's step model times them (`autopart.predict.messages`):
each tensor-parallel rank sends its share over the pipeline link (its slice of a
sequence-parallel tensor, its 1/t of a replicated one that splits, else all of it), and the
receivers all-gather the replicated tensors sent in parts over the group's own links. Timing a
replicated tensor whole over the pipeline link instead charged a TP layout without sequence
parallelism up to t times the transfer its plan then predicts."""

from __future__ import annotations

from autopart.solve.chain_costs import ChainCosts
from cost_models.comm import NodeSpan, node_span

__all__ = ["boundary_transfer_s"]


def boundary_transfer_s(costs: ChainCosts, layout, cluster) -> tuple[float, ...]:
    """Per block boundary of ``costs`` (cut at ``layout``'s tensor-parallel degree), the seconds
    from the send of what crosses it to its arrival on every receiving rank. Kept with the
    costs per what it reads of the layout and the cluster: the search asks for every layout it
    bounds and cuts, and a long chain has thousands of boundaries."""
    across = layout.pipeline_crosses_nodes(cluster.gpus_per_node)
    tp_span = node_span(layout.tp, 1, cluster.gpus_per_node, layout.world_size)
    # the links as the search's memo wraps them (a new wrapper per search) or not
    links = tuple(getattr(f, "__wrapped__", f) for f in (cluster.p2p_s, cluster.all_gather_s))
    key = ("boundary_transfer_s", layout.tp, across, tp_span, *links)

    def times() -> tuple[float, ...]:
        gathered = costs.boundary_gathered_bytes or (0,) * len(costs.boundary_bytes)
        pairs = tuple(zip(costs.boundary_bytes, gathered, strict=True))
        each = {pair: _transfer_s(*pair, layout.tp, across, tp_span, cluster) for pair in set(pairs)}  # a few sizes
        return tuple(each[pair] for pair in pairs)

    try:
        hash(key)
    except TypeError:  # links that cannot key a dict: computed each time
        return times()
    return costs.kept(key, times)


def _transfer_s(held: int, whole: int, tp: int, across: bool, tp_span: NodeSpan, cluster) -> float:
    if not whole:
        return cluster.p2p_s(held, across)
    return cluster.p2p_s(held - whole + whole // tp, across) + cluster.all_gather_s(whole, tp, tp_span)
