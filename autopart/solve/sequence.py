"""Megatron's sequence parallelism (Korthikanti et al., MLSys'23) as placements of block boundaries.

With tensor parallelism alone every TP rank holds the whole residual stream: the norms, the
dropouts and the residual adds between the TP matmuls run replicated, and their activations are
stored t times. Sequence parallelism splits that region over the sequence: what crosses from one
block (a layer) to the next is ``S(SEQUENCE_DIM)`` instead of replicated, the all-reduce after a
row-parallel linear becomes a reduce-scatter into that placement, and the input of a
column-parallel linear is all-gathered out of it (its gradient reduce-scattered back). The
volume is the all-reduce's, the region's activations fall t-fold.

The blocks are solved independently (``autopart.solve.tensor``), so the whole change to the
solver is the placement that a block receives its inputs in and hands its outputs on in: this
module decides it; the rules already offer the S(seq) strategies of the element-wise ops and
norms, and ``conversion`` the reduce-scatter.
"""

from __future__ import annotations

from autopart.passes.annotate import OpGraph
from autopart.ir.placement import REPLICATE, Placement, shard

__all__ = ["SEQUENCE_DIM", "boundary_placement"]

SEQUENCE_DIM = 1
"""Model inputs are batch-first (the model-file contract), so activations are (batch, sequence,
...) and the sequence is dim 1, as in every example and Hugging Face model."""


def boundary_placement(op_graph: OpGraph, name: str, t: int, sequence_parallel: bool) -> Placement:
    """How the value ``name`` crosses a block boundary on ``t`` ranks: split over the sequence
    when sequence parallelism is on and the value is an activation of the residual stream (it
    carries a gradient, has a sequence and a feature dim, and its sequence divides t ways);
    replicated otherwise (ids, masks and rotary tables carry no gradient and stay whole)."""
    cost = op_graph.nodes.get(name)
    meta = cost.output if cost is not None else None
    if not sequence_parallel or t == 1 or meta is None or cost.is_parameter or not cost.needs_grad or len(meta.shape) < 3:
        return REPLICATE
    if meta.shape[SEQUENCE_DIM] % t or meta.shape[SEQUENCE_DIM] < t:
        return REPLICATE
    return shard(SEQUENCE_DIM)
