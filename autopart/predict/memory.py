"""The one memory model of a rank's model state: weights, gradients and optimizer state, per
ZeRO level (``Plan.zero``).

Levels 2 and 3 run through FSDP2 with each stage one FSDP unit (``autopart.runtime.fully_sharded``
says why): the unit's parameters are whole while it computes (all step at level 2, during each
forward and backward at level 3) and autograd writes its whole gradients before FSDP
reduce-scatters them, so the peak holds a whole copy of both beside the shards of parameters,
gradients and optimizer state: 2P + (2P + S)/dp for P parameter bytes and S optimizer-state
bytes. ZeRO-1 holds 2P + S/dp, so on one rank's one stage neither level is smaller at its peak;
level 3 frees the parameters between a chunk's computations.

Precision (``Plan.dtype``). ``P`` is always the fp32 parameters' bytes: fp32 and
``bf16-autocast`` hold fp32 weights and fp32 gradients, and autocast's per-forward copies are
activations (annotate charges them to the matrix products that save them). ``bf16`` holds, beside
the same fp32 master weights, fp32 gradients and optimizer state, one bf16 working copy of every
weight (P/2, `autopart.runtime.forward`): Megatron-LM's 18 bytes per parameter with AdamW
(2 + 4 + 4 + 8). Under ZeRO-1 the fp32 masters are sharded with the optimizer state and the
weights held whole in bf16 only (`autopart.runtime.sharded_masters`, Megatron-LM's distributed
optimizer): P/2 + P + (P + S)/dp, 6 + 12/dp bytes per parameter with AdamW. Under ZeRO-2/3
FSDP holds the fp32 shards and gathers bf16 whole weights (P/2);
their bf16 whole gradients and the fp32 copy that FSDP reduce-scatters take P/2 + P at its peak,
so the whole copies weigh 2P as at fp32.
"""

from __future__ import annotations

from autopart.ir.tensors import working_dtype
from cost_models import model_state_bytes

__all__ = ["state_bytes"]


def state_bytes(parameter_bytes: int, *, optimizer: str, dp: int, zero: int, dtype: str = "fp32") -> int:
    """Peak bytes of weights, gradients and optimizer state for ``parameter_bytes`` of fp32
    parameters on one rank, in precision ``dtype``."""
    full = model_state_bytes(parameter_bytes, optimizer=optimizer)
    weights_and_grads = 2 * parameter_bytes
    working = parameter_bytes // 2 if working_dtype(dtype) is not None else 0  # bf16 copies beside fp32 masters
    if not zero or dp == 1:
        return full + working
    if zero == 1 and working:  # bf16 weights and fp32 gradients whole, the fp32 masters sharded with the state
        return working + parameter_bytes + (full - parameter_bytes) // dp
    if zero == 1:
        return weights_and_grads + (full - weights_and_grads) // dp
    return weights_and_grads + full // dp  # whole while computing, and the shards of everything
