"""The one memory model of a rank's model state: weights, gradients and optimizer state, per
ZeRO level (``Plan.zero``).

Levels 2 and 3 run through FSDP2 (``autopart.runtime.fully_sharded``). Autograd writes a
unit's whole gradients before FSDP reduce-scatters them, so while a unit computes it holds a
whole copy of its parameters and of their gradients beside the shards of parameters, gradients
and optimizer state.

- Level 2: each stage is one unit, whole over the whole step: 2P + (2P + S)/dp for P parameter
  bytes and S optimizer-state bytes. ZeRO-1 holds 2P + S/dp, so on one rank's one stage level 2
  is never smaller at its peak.
- Level 3: each repeated layer that a stage holds whole is a unit of its own (``layered``
  parameters: ``autopart.codegen.layers.layer_parameters``), the rest of the stage (embedding,
  head, norms) the root unit. The root's parameters are whole while the stage computes, 2P + (2P
  + S)/dp of them as at level 2; a layer's are whole only while it computes: (2P + S)/dp each,
  and per rank ``layers_in_flight_bytes``, the whole weights and gradients of two layers: FSDP
  gathers the next layer in backward (its backward prefetch) while the current one's gradients
  are being made, and in forward an accelerator runs ahead into the next layer's gather while
  the current one computes. A rank computes one stage at a time, so two layers per rank, not per
  stage. A layer that a cut splits runs inline in its stages' roots, where it is whole: the cut
  solver and the search's cutter charge those stages the difference
  (``PipelineProblem.split_layers``, ``autopart.solve.chain_costs``).

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

A frozen parameter (``requires_grad=False``: a fine-tune's pretrained base) has no gradient and
no optimizer state: P of weights (and the bf16 working copy), sharded at ZeRO-2/3 as the others'
weights are (FSDP shards it and gathers it alike); under ``bf16`` ZeRO-1 its fp32 master is
partitioned with the others (`autopart.runtime.sharded_masters`), its bf16 weight whole.

ZeRO-1's replicas own whole tensors, not even shares (`autopart.ir.owners`): ``state_bytes``
counts 1/dp of each parameter's ``owned_bytes``, and ``owner_excess_bytes`` what the replica that
owns most holds beyond those shares on a rank; a rank whose stage holds a vocabulary table at dp 64
holds the table's whole state on one replica, gigabytes more than 1/64 of it.

A stage also holds the buffers its ops read (a causal mask per attention layer, rotary tables,
BatchNorm's statistics), whole on every tensor-parallel and data-parallel rank and in their own
dtype: ``held_buffer_bytes`` says what one costs, and every figure of a rank's memory (the plan's,
the cut solver's, the search's) counts each buffer of each stage by it. A buffer that a forward
updates costs more while training (`autopart.runtime.buffer_updates`).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

import torch

from autopart.ir.owners import largest_share
from autopart.ir.tensors import TensorMeta, working_dtype
from autopart.runtime.buffer_updates import summed_bytes
from cost_models import model_state_bytes

__all__ = ["held_buffer_bytes", "state_bytes", "owned_bytes", "optimizer_group", "optimizer_groups",
           "owner_excess_bytes", "layers_in_flight_bytes", "LAYERS_IN_FLIGHT"]

LAYERS_IN_FLIGHT = 2
"""Layer units whose parameters and gradients a ZeRO-3 rank holds whole at once (the module's docstring)."""


def state_bytes(parameter_bytes: int, *, optimizer: str, dp: int, zero: int, dtype: str = "fp32",
                layered: bool = False, frozen: bool = False) -> int:
    """Peak bytes of weights, gradients and optimizer state for ``parameter_bytes`` of fp32
    parameters on one rank, in precision ``dtype``; ``layered``: they belong to a repeated layer,
    its own FSDP unit at level 3, whose whole copies ``layers_in_flight_bytes`` counts; ``frozen``:
    they do not train (weights alone)."""
    full = _model_state(parameter_bytes, optimizer=optimizer, frozen=frozen)
    whole_copies = parameter_bytes if frozen else 2 * parameter_bytes  # weights (and gradients) while computing
    working = parameter_bytes // 2 if working_dtype(dtype) is not None else 0  # bf16 copies beside fp32 masters
    if not zero or dp == 1:
        return full + working
    if zero == 1:
        owned = owned_bytes(parameter_bytes, optimizer=optimizer, dp=dp, zero=zero, dtype=dtype, frozen=frozen)
        return full + working - owned + owned // dp
    if zero == 3 and layered:
        return full // dp
    return whole_copies + full // dp  # whole while computing, and the shards of everything


def held_buffer_bytes(buffer: TensorMeta, *, updated: bool) -> int:
    """What a stage holding ``buffer`` holds for it through a training step: its bytes and, where
    its forward updates it (the stage file's ``updated_buffers``), what
    `autopart.runtime.buffer_updates.BufferUpdates` keeps beside it: a copy of its starting values
    and the sum of its forwards' values, in fp32 for a 16-bit float, int64 for a flag and two int64
    halves per element for an integer (`autopart.runtime.buffer_updates.summed_bytes`). A complex
    buffer is never tracked."""
    dtype = getattr(torch, buffer.dtype)
    if not updated or dtype.is_complex:
        return buffer.nbytes
    return 2 * buffer.nbytes + buffer.numel * summed_bytes(dtype)


def owned_bytes(parameter_bytes: int, *, optimizer: str, dp: int, zero: int, dtype: str = "fp32",
                frozen: bool = False) -> int:
    """The bytes of ``parameter_bytes``' state that ZeRO-1 leaves to the one replica owning the
    tensor: its optimizer state, and under ``bf16`` its fp32 master too (the bf16 weight and the
    fp32 gradient stay whole on every replica). 0 where nothing is sharded that way."""
    if zero != 1 or dp == 1:
        return 0
    gradients = 0 if frozen else parameter_bytes
    whole = gradients + (0 if working_dtype(dtype) is not None else parameter_bytes)  # fp32 weights stay whole
    return _model_state(parameter_bytes, optimizer=optimizer, frozen=frozen) - whole


def _model_state(parameter_bytes: int, *, optimizer: str, frozen: bool) -> int:
    """Weights, gradients and optimizer state of fp32 parameters; a frozen one's weights alone."""
    return parameter_bytes if frozen else model_state_bytes(parameter_bytes, optimizer=optimizer)


def optimizer_group(dtype: str, decayed: bool) -> int:
    """The index of a parameter's group as ZeRO-1 partitions it (`owner_excess_bytes`): under a
    working dtype `autopart.runtime.sharded_masters` partitions all the rank's tensors at once; else
    torch's ``ZeroRedundancyOptimizer`` takes the recipe's groups in turn, the decayed first
    (`autopart.runtime.recipe.parameter_groups`)."""
    return 0 if decayed or working_dtype(dtype) is not None else 1


def optimizer_groups(names: Iterable[str], *, dtype: str, decayed: Container[str]) -> list[list[str]]:
    """``names`` in the groups that ZeRO-1 partitions in turn (`optimizer_group`), in their order."""
    groups: dict[int, list[str]] = {}
    for name in names:
        groups.setdefault(optimizer_group(dtype, name in decayed), []).append(name)
    return [groups[g] for g in sorted(groups)]


def owner_excess_bytes(groups: Sequence[Sequence[int]], dp: int) -> int:
    """What the replica owning most holds beyond the 1/dp shares that `state_bytes` counts, for
    one rank's tensors' ``owned_bytes`` in the optimizer's parameter groups (their order and
    membership as the runtime builds them: `autopart.ir.owners`)."""
    if dp == 1:
        return 0
    return largest_share(groups, dp) - sum(size // dp for sizes in groups for size in sizes)


def layers_in_flight_bytes(layer_bytes: int, *, dp: int, zero: int) -> int:
    """Per rank, the whole weights and gradients of the layer units in flight at level 3, for the
    largest layer's ``layer_bytes`` of fp32 parameters (2 bytes each way under ``bf16``: its bf16
    weights and gradients and the fp32 copy that FSDP reduce-scatters weigh what fp32's do)."""
    if zero != 3 or dp == 1:
        return 0
    return LAYERS_IN_FLIGHT * 2 * layer_bytes
