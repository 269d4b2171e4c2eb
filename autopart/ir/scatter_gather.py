"""Pipeline messages split over the tensor-parallel group (Megatron's scatter-gather).

A tensor that crosses a pipeline boundary leaves its stage replicated: every tensor-parallel rank
holds the same copy and would send the whole of it to its peer in the next stage, t identical
messages over t links. Instead, each sender sends the 1/t of the flattened tensor at its own
tensor-parallel index, and each receiver gathers the t parts from its group, over the links
inside the node, which are much faster than the links between the nodes that pipeline stages
usually span (Narayanan et al., SC21, §4.1). Gradients going back are replicated too (the stage's
backward all-reduces what its split ops read), so they travel the same way.

A tensor whose element count t does not divide travels whole. The runtime
(`autopart.runtime.p2p`) and the step-time model (`autopart.predict.messages`) read this one rule.
"""

from __future__ import annotations

__all__ = ["parts"]


def parts(numel: int, tp: int) -> int:
    """How many parts a tensor of ``numel`` elements travels in between stages at tensor-parallel degree ``tp``."""
    return tp if tp > 1 and numel > 0 and numel % tp == 0 else 1
