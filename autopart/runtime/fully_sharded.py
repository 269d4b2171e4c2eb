"""ZeRO-2 and ZeRO-3: a stage's gradients, and at level 3 its parameters, sharded over the
data-parallel group with torch's FSDP2 (``fully_shard``).

FSDP gathers a unit's parameters in a pre-forward hook of its module, and a generated stage
runs a repeated layer through a stage method with the layer's module as an argument
(``self.transformer_block(x, self.layers[0])``, `autopart.codegen.layers`): the layer module's
own forward never runs. So at level 3 each layer that the stage class lists in
``layer_methods`` is made an FSDP unit of its own, and given a method that runs the stage's
body on it, which ``register_fsdp_forward_method`` wraps in the unit's pre- and post-forward
hooks (the gather, the reshard, and the backward hooks FSDP installs from them); the stage's
method is routed through the layer's. The stage itself is the root unit: the embedding, the
head, the norms and whatever layer is written inline. A layer's parameters are then whole only
while it computes (and while FSDP prefetches it, the next one in backward), not the stage's.
Level 2 keeps the stage one unit: it holds every parameter whole over the step anyway.

A pipeline calls a stage's forward and backward once per microbatch, interleaved with other
microbatches, so what FSDP does between them is the choice that matters (torch's own pipeline
stage makes the same one; pytorch/pytorch#164756 is what goes wrong when the timing is left to
FSDP's defaults):

- level 2: parameters are gathered at the stage's first forward of the step and stay whole
  until the step's end (no reshard after forward or backward), so each is gathered once a step;
  gradients are reduce-scattered after every microbatch's backward, so only their shards
  accumulate. ``end_of_step`` reshards before the optimizer steps the shards: a parameter left
  whole would be the value from before the step at the next forward.
- level 3: every unit resharded after its forward and after its backward: gathered twice per
  microbatch, and whole only while it computes.

FSDP averages the reduced gradients over the group, as ``average_gradients`` does for level 0
and 1, so the step's loss stays the mean over the global batch. Zero-bubble schedules split a
backward into I and W with ``torch.autograd.grad``, which FSDP's post-backward hooks do not
follow; the plan refuses that combination (``check_level``).

FSDP and DTensor are imported on first use: every rank imports this module, and importing them
costs each rank's start about a second where no stage is sharded.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopart.ir.errors import ConfigError

__all__ = ["FSDP_LEVELS", "check_level", "check_shardable", "runs_here", "scalar_parameter", "end_of_step", "full_state",
           "is_sharded", "local", "shard_stage"]

FSDP_LEVELS = (2, 3)


def runs_here(level: int) -> bool:
    """Whether this torch runs ``level``: FSDP's levels need ``torch.distributed.fsdp.fully_shard``,
    public from torch 2.6 (before, a private module's, whose interface moved)."""
    if level not in FSDP_LEVELS:
        return True
    import torch.distributed.fsdp as fsdp

    return hasattr(fsdp, "fully_shard") and hasattr(fsdp, "register_fsdp_forward_method")


def check_level(level: int, *, dp: int, split_backward: bool) -> str | None:
    """Why ``level`` cannot run with this mesh and schedule (or this torch), or None when it can."""
    if not runs_here(level):
        return (f"--zero {level} runs on torch.distributed.fsdp.fully_shard, which torch {torch.__version__} lacks "
                "(public from torch 2.6); install torch 2.6 or later, or use --zero 1")
    if level in FSDP_LEVELS and dp < 2:
        return f"--zero {level} shards over data-parallel ranks; it needs --dp 2 or more"
    if level in FSDP_LEVELS and split_backward:
        return (f"--zero {level} does not run with a zero-bubble schedule (its split backward bypasses FSDP's "
                "gradient hooks); use --schedule 1f1b or interleaved, or --zero 1")
    return None


def scalar_parameter(module: nn.Module) -> str | None:
    """The name of a parameter of ``module`` that has no dimensions (a learnable scalar), if any:
    FSDP's ``fully_shard`` refuses one, having no dim 0 to split."""
    return next((name for name, parameter in module.named_parameters() if parameter.dim() == 0), None)


def check_shardable(module: nn.Module, level: int) -> str | None:
    """Why ``module``'s parameters cannot be sharded at ``level`` (`scalar_parameter`), or None."""
    scalar = scalar_parameter(module) if level in FSDP_LEVELS else None
    if scalar is None:
        return None
    return (f"--zero {level} shards parameters with FSDP's fully_shard, which refuses the 0-dim parameter "
            f"{scalar!r}; make it a tensor of one element (torch.ones(1)), or use --zero 1")


def shard_stage(module: nn.Module, mesh: DeviceMesh, level: int, param_dtype: torch.dtype | None = None) -> None:
    """Make ``module`` (a stage, its weights loaded) fully sharded over the 1-D data-parallel ``mesh``.

    ``param_dtype`` (``bf16``'s working weights): FSDP casts the fp32 shards to it before it
    gathers them, and reduce-scatters the gradients in fp32 into fp32 shards, where the optimizer
    steps the fp32 master shards: the precision `autopart.runtime.forward` keeps without FSDP."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    refused = check_shardable(module, level)  # a hand-edited plan: the compile refuses it before this
    if refused:
        raise ConfigError(refused)
    per_microbatch = level == 3
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    shard = functools.partial(fully_shard, mesh=mesh, reshard_after_forward=per_microbatch, mp_policy=policy)
    if per_microbatch:
        for method, paths in getattr(type(module), "layer_methods", {}).items():
            _shard_layers(module, method, paths, shard)
    shard(module)  # the root last: FSDP leaves out the parameters that a unit below it holds
    assert isinstance(module, FSDPModule)
    module.set_reshard_after_backward(per_microbatch)  # every unit of the stage


LAYER_FORWARD = "autopart_layer_forward"
"""The method of a layer unit that FSDP wraps in its hooks: the stage's body, run on that layer."""


def _shard_layers(module: nn.Module, method: str, paths: tuple[str, ...], shard) -> None:
    """Make each layer at ``paths`` an FSDP unit whose ``LAYER_FORWARD`` runs the stage's ``method``
    on it, and route the stage's ``method`` (called as ``method(*inputs, layer)``) to it."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    body = getattr(module, method)
    for path in paths:
        layer = module.get_submodule(path)
        shard(layer)
        setattr(layer, LAYER_FORWARD, functools.partial(body, layer=layer))
        register_fsdp_forward_method(layer, LAYER_FORWARD)
    setattr(module, method, functools.partial(_routed, body))


def _routed(body, *arguments):
    """A stage's layer method under per-layer units: the call goes through the layer's hooked
    method; a layer that codegen left in the root unit (its tensors read elsewhere too) runs as ever."""
    *inputs, layer = arguments
    hooked = getattr(layer, LAYER_FORWARD, None)
    return hooked(*inputs) if hooked is not None else body(*inputs, layer)


def end_of_step(modules: list[nn.Module]) -> None:
    """Free the whole parameters that level 2 kept over the step, before the optimizer steps their shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()


def is_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor; none can exist before torch.distributed.tensor was imported (by ``shard_stage``)."""
    loaded = sys.modules.get("torch.distributed.tensor")
    return loaded is not None and isinstance(tensor, loaded.DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor: what collectives and norms work on."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's state dict with whole tensors. Gathers: every rank of the group must call it."""
    return {k: v.full_tensor() if is_sharded(v) else v for k, v in module.state_dict().items()}
