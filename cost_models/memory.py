"""Memory that training needs besides activations: model states and the framework itself.

Activations depend on the graph and are measured by the annotate pass; what is here depends
only on the parameter count, the optimizer and the device, so it is a formula.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from autopart.ir.errors import ConfigError

__all__ = ["FRAMEWORK_OVERHEAD_BYTES", "OPTIMIZER_STATES", "model_state_bytes", "communicator_bytes",
           "pipeline_channels"]

_MIB = 1 << 20

FRAMEWORK_OVERHEAD_BYTES: Mapping[str, int] = MappingProxyType({
    # CUDA context, cuBLAS/cuDNN workspaces and the caching allocator's first blocks: about
    # 500 MiB on an A100/H100 with PyTorch 2.x, before any tensor of the model exists.
    "cuda": 500 * _MIB,
    # The HIP runtime and rocBLAS/hipBLASLt workspaces take about as much.
    "rocm": 500 * _MIB,
    # The process itself: Python with torch imported, rounded up (tests/test_cost_memory.py
    # measures a fresh one; `autopart profile-comm` measures a rank and replaces this figure).
    "cpu": 320 * _MIB,
})
"""Bytes each process takes on its device before the model, by `DeviceSpec.kind`."""

OPTIMIZER_STATES: Mapping[str, int] = MappingProxyType({
    "sgd": 0,  # plain SGD without momentum keeps nothing between steps
    "sgd_momentum": 1,  # one momentum buffer
    "adam": 2,  # first and second moments
    "adamw": 2,
})
"""How many tensors the size of the (fp32) parameters each optimizer keeps."""


def model_state_bytes(parameter_bytes: int, *, optimizer: str, master_weights: bool = False) -> int:
    """Bytes of parameters, gradients and optimizer state for parameters of ``parameter_bytes``.

    Gradients have the parameters' dtype. Without master weights the optimizer keeps its state
    in the parameters' dtype (what ``torch.optim`` does), so fp32 AdamW costs
    4Ψ + 4Ψ + 8Ψ = 16Ψ for Ψ parameters. With master weights the parameters are 16-bit and the
    optimizer updates an fp32 copy whose state is fp32 too: 2Ψ + 2Ψ + (4Ψ + 8Ψ) = 16Ψ for
    AdamW, the mixed-precision figure of ZeRO (Rajbhandari et al., SC20, §5).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"unknown optimizer '{optimizer}'; use one of "
                          f"{', '.join(OPTIMIZER_STATES)}")
    if parameter_bytes < 0:
        raise ValueError(f"parameter_bytes must be >= 0, got {parameter_bytes}")
    states = OPTIMIZER_STATES[optimizer]
    if not master_weights:
        return parameter_bytes * (2 + states)
    fp32_copy = 2 * parameter_bytes  # 16-bit parameters: an fp32 value is twice their size
    return parameter_bytes * 2 + fp32_copy * (1 + states)


NCCL_BUFFER_BYTES = 4 * _MIB
"""NCCL_BUFFSIZE's default (NCCL documentation, "Environment Variables": 4194304). NCCL keeps a
buffer of this size for every channel and every peer it is connected to in a communicator, in
device memory outside PyTorch's allocator, for as long as the communicator lives: so it is
memory that ``torch.cuda.max_memory_allocated`` never shows, yet that a plan must leave free.
The LL and LL128 protocols keep smaller buffers beside it, which this figure leaves out."""

NCCL_CHANNELS = 16
"""Channels per communicator: NCCL opens 16 to 32 on an NVLink/NVSwitch node of H100s and fewer
on PCIe; 16 is the common figure, so the estimate errs low rather than refuse a plan that fits."""


def communicator_bytes(kind: str, *, pp: int, tp: int, dp: int, schedule: str = "1f1b") -> int:
    """Device memory of the collective library's own buffers on one rank of a (pp, tp, dp) mesh:
    `NCCL_BUFFER_BYTES` per channel for every peer it is connected to in each communicator. It
    belongs to the whole world's group (step time, peaks) and to its data- and tensor-parallel
    groups, a ring in each (two peers, one in a group of two); a tied parameter's group, of a few
    ranks, is left out. A pipeline's messages go over a group per kind and direction
    (`pipeline_channels`), which gives each pair of ranks that exchange over it a communicator
    of its own. Nothing on the CPU, where gloo's buffers are the process's own memory."""
    if kind not in ("cuda", "rocm"):  # RCCL keeps NCCL's buffers
        return 0
    peers = sum(min(size - 1, 2) for size in (pp * tp * dp, dp, tp) if size > 1) + pipeline_channels(schedule, pp)
    return peers * NCCL_CHANNELS * NCCL_BUFFER_BYTES


def pipeline_channels(schedule: str, pp: int) -> int:
    """The pipeline communicators of the busiest rank (`autopart.runtime.p2p.Channels`: one per
    kind, direction and pair): to each of its neighbours (two past two stages), activations one
    way and gradients the other, and both ways where the messages turn back, as ZB-V's do at the
    bottom of its V and interleaving's between two ranks."""
    if pp < 2:
        return 0
    both_ways = schedule == "zbv" or (schedule == "interleaved" and pp == 2)
    return min(pp - 1, 2) * (4 if both_ways else 2)
