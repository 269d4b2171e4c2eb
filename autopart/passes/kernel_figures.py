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
        backward_flops=_model_backward_flops(forward, (*backward_input, *backward_weight)),
        forward_s=times.forward_s,
        backward_input_s=times.backward_input_s,
        backward_weight_s=times.backward_weight_s,
        selective_recompute_s=times.forward_s * share,
    )


def _model_backward_flops(forward: Sequence[Kernel], backward: Sequence[Kernel]) -> float:
    """The backward's model FLOPs, what MFU counts: its kernels', but a fused attention backward's
    at twice its forward's. That kernel computes Q·Kᵀ again before its four products (and its
    FLOPs and time count it), a recompute that model FLOPs leave out, as they leave out the
    recompute of activations (Narayanan et al.'s 72·B·L·s·h²·(1 + s/(6h) + ...), PaLM's MFU):
    counted, a GPT at s 32k and h 4096 was credited 9% more work than it does."""
    fused = [k for k in backward if k.category == "attention"]
    if not fused:
        return _flops(backward)
    return _flops(k for k in backward if k.category != "attention") + 2 * _flops(
        k for k in forward if k.category == "attention")


def _flops(kernels: Iterable[Kernel]) -> float:
    return float(sum(k.flops for k in kernels))
