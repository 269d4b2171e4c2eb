"""A node's FLOPs and seconds from its kernels: what annotation records per node, and what the
size lines (``autopart.passes.scale``) record again for a size read off a line, by the same arithmetic."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from autopart.ir.recompute import keeps_output
from cost_models import CostModel, Kernel, OpTimes

__all__ = ["kernel_figures", "recompute_share"]


def recompute_share(forward: Sequence[Kernel], cost_model: CostModel) -> float:
    """The share of a node's forward time in the ops that selective recompute runs again."""
    total = cost_model.kernels_time(forward)
    if total <= 0:
        return 1.0
    return max(0.0, 1.0 - cost_model.kernels_time(k for k in forward if keeps_output(k.op)) / total)


def kernel_figures(kernels: tuple[tuple[Kernel, ...], ...], times: OpTimes, share: float) -> dict[str, float]:
    """A node's FLOPs and seconds from its kernels (forward, input gradients, weight gradients),
    their ``times`` and the share of its forward that selective recompute runs again."""
    forward, backward_input, backward_weight = kernels
    return dict(
        forward_flops=_flops(forward),
        backward_flops=_flops(backward_input) + _flops(backward_weight),
        forward_s=times.forward_s,
        backward_input_s=times.backward_input_s,
        backward_weight_s=times.backward_weight_s,
        selective_recompute_s=times.forward_s * share,
    )


def _flops(kernels: Iterable[Kernel]) -> float:
    return float(sum(k.flops for k in kernels))
