"""The one memory model of a rank's model state: weights, gradients and optimizer state."""

from __future__ import annotations

from cost_models import model_state_bytes

__all__ = ["state_bytes"]


def state_bytes(parameter_bytes: int, *, optimizer: str, dp: int, zero: bool) -> int:
    """Weights, gradients and optimizer state of ``parameter_bytes`` of parameters on one rank;
    with ZeRO-1 the optimizer state is shared out over the ``dp`` data-parallel ranks."""
    full = model_state_bytes(parameter_bytes, optimizer=optimizer)
    if not zero:
        return full
    weights_and_grads = 2 * parameter_bytes
    return weights_and_grads + (full - weights_and_grads) // dp
