"""Where a rank's data-parallel collectives fall in the step, per ZeRO level (``Plan.zero``).

Levels 0 and 1 all-reduce the gradients in buckets as they become final, beside the backward
(`autopart.predict.reduction` models that); level 1 then gathers the updated shards after the
optimizer step, which nothing overlaps: fp32 weights (ZeroRedundancyOptimizer), or under ``bf16``
the bf16 weights that each owner of fp32 masters broadcasts (`autopart.runtime.sharded_masters`),
half the bytes (`gathered_bytes`). Level 2 (FSDP) gathers the parameters at the step's first
forward and reduce-scatters the gradients after every microbatch's backward: the gather must
end before the stage computes, so it adds; a reduce-scatter is left running: on a GPU it
overlaps the next action (its own stream) as far as that action lasts, slowing it meanwhile
(`autopart.predict.fully_sharded.added_beside`), and the step waits for its last one; on a CPU it
runs on the cores that compute and adds. Level 3 gathers before
every forward and every backward too, a layer at a time beside the compute of the one before
(`autopart.predict.fully_sharded`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopart.ir.tensors import working_dtype
from autopart.predict.fully_sharded import Piece, added_beside, fully_sharded_cost
from cost_models.base import CostModel

__all__ = ["DataParallelComm", "data_parallel_comm", "gathered_bytes"]


def gathered_bytes(parameter_bytes: float, dtype: str) -> float:
    """The bytes a gather of the weights moves for ``parameter_bytes`` of fp32 parameters: the
    weights in the dtype the replicas compute with. Under ``bf16`` ZeRO-1's post-step gather
    moves the bf16 weights held beside the sharded masters, and FSDP (levels 2 and 3) casts its
    fp32 shards to bf16 before it gathers them (``MixedPrecisionPolicy(param_dtype=bfloat16)``,
    `autopart.runtime.fully_sharded`); gradients are reduced in fp32 either way."""
    return parameter_bytes / 2 if working_dtype(dtype) is not None else parameter_bytes


@dataclass(frozen=True)
class DataParallelComm:
    """Seconds a stage's data-parallel collectives add: to each of its forwards, to each of its
    backwards, and once to the step's tail (after the pipeline)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    tail_s: float = 0.0


def data_parallel_comm(zero: int, parameter_bytes: float, *, dp: int, nodes: int, cost_model: CostModel,
                       overlapped: bool, members: int | None = None, slowdown: float = 0.0, hidden_behind_s: float = 0.0,
                       dtype: str = "fp32", pieces: Sequence[Piece] = (), trained: float = 1.0) -> DataParallelComm:
    """The collectives of one stage holding ``parameter_bytes`` (this rank's, after tensor
    parallelism), over ``dp`` replicas on ``nodes`` nodes, ``members`` of them on the node holding the fewest
    (`cost_models.comm.fewest_members`; None: spread evenly). ``overlapped``: collectives run beside
    the compute (a GPU's streams), slowing it by ``slowdown`` while they run (the device's
    ``overlap_compute_slowdown``); a reduce-scatter still running as a backward ends runs beside
    the next action, which takes at least ``hidden_behind_s`` (the stage's forward: what follows
    a backward in a pipeline's steady state), and what it runs past that action or slows it by
    adds to the backward. ``dtype``: the plan's precision, what the gathers move
    (`gathered_bytes`). ``pieces``: the stage's compute with its layer units, in forward order
    (level 3; none: the stage is one unit). ``trained``: the share of the bytes that train; the
    frozen rest is gathered as the others are, and has no gradient to reduce-scatter."""
    if dp == 1:
        return DataParallelComm()

    def time(kind: str) -> float:
        nbytes = gathered_bytes(parameter_bytes, dtype) if kind == "all_gather" else parameter_bytes * trained
        return cost_model.collective_time(kind, nbytes, dp, nodes=nodes, members=members)

    if zero in (0, 1):  # the all-reduce overlaps the backward (`autopart.predict.reduction`); ZeRO-1's
        return DataParallelComm(tail_s=time("all_gather") if zero == 1 else 0.0)  # update is shared after the step
    if zero == 2:
        scatter = time("reduce_scatter")  # each runs beside the next action
        reduce = added_beside(scatter, hidden_behind_s, slowdown) if overlapped else scatter
        last = scatter if overlapped else 0.0  # the step waits for the last one
        return DataParallelComm(backward_s=reduce, tail_s=time("all_gather") + last)
    layered = fully_sharded_cost(
        pieces or (Piece(hidden_behind_s, 2 * hidden_behind_s),), parameter_bytes - sum(p.count * p.unit_bytes for p in pieces),
        gather_s=lambda nbytes: cost_model.collective_time("all_gather", gathered_bytes(nbytes, dtype), dp, nodes=nodes,
                                                            members=members),
        reduce_s=lambda nbytes: cost_model.collective_time("reduce_scatter", nbytes * trained, dp, nodes=nodes,
                                                            members=members),
        overlapped=overlapped, slowdown=slowdown)
    return DataParallelComm(forward_s=layered.forward_s, backward_s=layered.backward_beside(hidden_behind_s),
                            tail_s=layered.pending_s)
