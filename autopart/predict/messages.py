"""The time of one pipeline boundary's messages, split over the tensor-parallel group by the rule
of `autopart.ir.scatter_gather` (the rule the runtime's sends and receives follow)."""

from __future__ import annotations

from collections.abc import Iterable

from autopart.ir.scatter_gather import gathered, sent_bytes
from autopart.ir.tensors import TensorMeta
from autopart.options import CompileOptions
from cost_models import CostModel

__all__ = ["boundary_seconds", "message_seconds"]


def message_seconds(
    cost_model: CostModel, metas: Iterable[TensorMeta], *, tp: int, across_nodes: bool, tp_nodes: int,
    tp_members: int | None = None,
) -> float:
    """Seconds from the send of one boundary's tensors to their arrival on every receiving
    tensor-parallel rank, whole or as the slice it holds: each rank's share over the pipeline link
    (all ranks send theirs at once, on their own links), then the all-gather inside the
    tensor-parallel group (on ``tp_nodes`` nodes, ``tp_members`` of it on the node holding the
    fewest) of the replicated tensors sent in parts."""
    metas = list(metas)
    sent = sum(sent_bytes(meta, tp) for meta in metas)
    whole = sum(meta.nbytes for meta in metas if gathered(meta, tp))
    seconds = cost_model.p2p_time(sent, across_nodes=across_nodes)
    if whole:
        seconds += cost_model.collective_time("all_gather", whole, tp, nodes=tp_nodes, members=tp_members)
    return seconds


def boundary_seconds(options: CompileOptions, cost_model: CostModel, tensors) -> float:
    """One boundary's messages (``(name, TensorMeta)`` pairs), split over the options' tensor-parallel group."""
    return message_seconds(cost_model, [meta for _, meta in tensors], tp=options.tp,
                           across_nodes=options.pipeline_crosses_nodes, tp_nodes=options.tensor_parallel_span.nodes,
                           tp_members=options.tensor_parallel_span.fewest)
