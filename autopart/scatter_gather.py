"""Pipeline messages split over the tensor-parallel group (Megatron's scatter-gather).

A tensor that crosses a pipeline boundary leaves its stage replicated: every tensor-parallel rank
holds the same copy and would send the whole of it to its peer in the next stage, t identical
messages over t links. Instead, each sender sends the 1/t of the flattened tensor at its own
tensor-parallel index, and each receiver gathers the t parts from its group, over the links
inside the node, which are much faster than the links between the nodes that pipeline stages
usually span (Narayanan et al., SC21, §4.1). Gradients going back are replicated too (the stage's
backward all-reduces what its split ops read), so they travel the same way.

A tensor whose element count t does not divide travels whole. The runtime
(`autopart.runtime.p2p`) and the step-time model (`message_seconds`) read this one rule.
"""

from __future__ import annotations

from collections.abc import Iterable

from autopart.annotate import TensorMeta
from cost_models import CostModel

__all__ = ["parts", "message_seconds"]


def parts(numel: int, tp: int) -> int:
    """How many parts a tensor of ``numel`` elements travels in between stages at tensor-parallel degree ``tp``."""
    return tp if tp > 1 and numel > 0 and numel % tp == 0 else 1


def message_seconds(
    cost_model: CostModel, metas: Iterable[TensorMeta], *, tp: int, across_nodes: bool, tp_across_nodes: bool
) -> float:
    """Seconds from the send of one boundary's tensors to their arrival whole on every receiving
    tensor-parallel rank: each rank's share over the pipeline link (all ranks send theirs at once,
    on their own links), then the all-gather inside the tensor-parallel group."""
    sent, gathered = 0, 0
    for meta in metas:
        split = parts(meta.numel, tp)
        sent += meta.nbytes // split
        if split > 1:
            gathered += meta.nbytes
    seconds = cost_model.p2p_time(sent, across_nodes=across_nodes)
    if gathered:
        seconds += cost_model.collective_time("all_gather", gathered, tp, across_nodes=tp_across_nodes)
    return seconds
