"""The one memory model of a rank's model state: weights, gradients and optimizer state, per
ZeRO level (``Plan.zero``).

Levels 2 and 3 run through FSDP2 with each stage one FSDP unit (``autopart.runtime.fully_sharded``
says why): the unit's parameters are whole while it computes (all step at level 2, during each
forward and backward at level 3) and autograd writes its whole gradients before FSDP
reduce-scatters them, so the peak holds a whole copy of both beside the shards of parameters,
gradients and optimizer state: 2P + (2P + S)/dp for P parameter bytes and S optimizer-state
bytes. ZeRO-1 holds 2P + S/dp, so on one rank's one stage neither level is smaller at its peak;
level 3 frees the parameters between a chunk's computations.
"""

from __future__ import annotations

from cost_models import model_state_bytes

__all__ = ["state_bytes"]


def state_bytes(parameter_bytes: int, *, optimizer: str, dp: int, zero: int) -> int:
    """Peak bytes of weights, gradients and optimizer state for ``parameter_bytes`` of parameters on one rank."""
    full = model_state_bytes(parameter_bytes, optimizer=optimizer)
    weights_and_grads = 2 * parameter_bytes
    if not zero or dp == 1:
        return full
    if zero == 1:
        return weights_and_grads + (full - weights_and_grads) // dp
    return weights_and_grads + full // dp  # whole while computing, and the shards of everything
