"""What data parallelism costs a rank, per ZeRO level: the bytes of its model state, and the
seconds of its collectives, where in the step they fall.

Levels (``Plan.zero``): 0 replicates everything; 1 shards the optimizer state (torch's
ZeroRedundancyOptimizer); 2 and 3 shard gradients and parameters through FSDP2 with each stage
one FSDP unit (``autopart.runtime.fully_sharded`` says why), which fixes the figures below:

- memory: the unit's parameters are whole while it computes (all step at level 2, during each
  forward and backward at level 3) and autograd writes its whole gradients before FSDP
  reduce-scatters them, so the peak holds a whole copy of both beside the shards of
  parameters, gradients and optimizer state: 2P + (2P + S)/dp for P parameter bytes and S
  optimizer-state bytes. ZeRO-1 holds 2P + S/dp, so on one rank's stage neither level is
  smaller at its peak; level 3 frees the parameters between a chunk's computations, which
  is what makes it pay when a rank holds several chunks or a parameter-heavy stage idles.
- time: level 2 gathers the parameters at the step's first forward and reduce-scatters the
  gradients after every microbatch's backward; level 3 gathers before every forward and every
  backward too. A gather must end before the unit computes, so it adds to the action; a
  reduce-scatter is left running: on a GPU it overlaps the next action (its own stream) as far
  as that action lasts and the step waits for its last one; on a CPU it runs on the cores that
  compute and adds.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models import model_state_bytes
from cost_models.base import CostModel

__all__ = ["ZERO_LEVELS", "DataParallelComm", "data_parallel_comm", "state_bytes"]

ZERO_LEVELS = (0, 1, 2, 3)


def state_bytes(parameter_bytes: int, *, optimizer: str, dp: int, zero: int) -> int:
    """Peak bytes of weights, gradients and optimizer state for ``parameter_bytes`` of parameters on one rank."""
    full = model_state_bytes(parameter_bytes, optimizer=optimizer)
    weights_and_grads = 2 * parameter_bytes
    if not zero or dp == 1:
        return full
    if zero == 1:
        return weights_and_grads + (full - weights_and_grads) // dp
    return weights_and_grads + full // dp  # whole while computing, and the shards of everything


@dataclass(frozen=True)
class DataParallelComm:
    """Seconds a stage's data-parallel collectives add: to each of its forwards, to each of its
    backwards, and once to the step's tail (after the pipeline)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    tail_s: float = 0.0


def data_parallel_comm(zero: int, parameter_bytes: float, *, dp: int, across_nodes: bool, cost_model: CostModel,
                       overlapped: bool, hidden_behind_s: float = 0.0) -> DataParallelComm:
    """The collectives of one stage holding ``parameter_bytes`` (this rank's, after tensor
    parallelism). ``overlapped``: a reduce-scatter runs beside the next action (a GPU's
    streams), which takes at least ``hidden_behind_s`` (the stage's forward: what follows a
    backward in a pipeline's steady state); what it runs past that adds to the backward."""
    if dp == 1:
        return DataParallelComm()

    def time(kind: str) -> float:
        return cost_model.collective_time(kind, parameter_bytes, dp, across_nodes=across_nodes)

    if zero in (0, 1):  # the gradient all-reduce once the pipeline drained; ZeRO-1 then shares the updated shards
        return DataParallelComm(tail_s=time("all_reduce") + (time("all_gather") if zero == 1 else 0.0))
    reduce = max(0.0, time("reduce_scatter") - hidden_behind_s) if overlapped else time("reduce_scatter")
    last = time("reduce_scatter") if overlapped else 0.0  # the step waits for the last one
    if zero == 2:
        return DataParallelComm(backward_s=reduce, tail_s=time("all_gather") + last)
    return DataParallelComm(forward_s=time("all_gather"), backward_s=time("all_gather") + reduce, tail_s=last)
