"""The optimizers that the generated programs and the single-process reference share."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from autopart.ir.errors import ConfigError
from autopart.runtime.sharded_masters import ShardedMasters

__all__ = ["OPTIMIZERS", "make_optimizer"]

OPTIMIZERS = ("sgd", "adamw")


def make_optimizer(
    name: str,
    parameters: Iterable[torch.nn.Parameter] | list[dict],
    lr: float,
    *,
    zero_group: torch.distributed.ProcessGroup | None = None,
    shard_masters: bool = False,
    fully_sharded: bool = False,
    momentum: float = 0.0,
    nesterov: bool = False,
    betas: tuple[float, float] | None = None,
) -> torch.optim.Optimizer:
    """SGD or AdamW; with ``zero_group``, its state sharded over that group (ZeRO-1), and with
    ``shard_masters`` (``--dtype bf16``) the fp32 master weights too, the weights held in bf16
    (`autopart.runtime.sharded_masters`). ``fully_sharded``: the parameters are FSDP's DTensors
    (ZeRO-2 and 3). ``momentum`` and ``nesterov``: SGD's (train.py's ``--momentum``, ``--nesterov``,
    `autopart.runtime.recipe.Recipe`), as ``torch.optim.SGD`` takes them; ``betas``: AdamW's
    (``--betas``), None for torch's default.

    On the CPU, one tensor at a time (``foreach=False``, but for FSDP's parameters): the same
    per-tensor arithmetic on every rank and in the reference, whichever parameters each holds. On
    a GPU, fused AdamW and foreach SGD: a per-tensor loop there launches kernels for every
    parameter and holds the host back; the reference on a GPU makes the same choice, and fused
    kernels compute each element alike however the tensors are grouped. ``parameters`` may be
    parameter groups (`autopart.runtime.recipe.parameter_groups`: weight decay per parameter).
    None at all (a rank whose stages are the loss alone) gives an optimizer of one empty group:
    its steps do nothing, and the learning-rate schedule and checkpoints treat it as any other.
    """
    params = list(parameters)
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")
    tensors = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
    if not tensors:  # torch refuses an empty list, not an empty group; nothing to shard either
        params, zero_group = [{"params": []}], None
    cuda = bool(tensors) and tensors[0].is_cuda
    # A per-tensor update of FSDP's DTensors sends each elementwise op through DTensor's dispatch
    # in Python, which on a CPU took a third of the GPT example's ZeRO-2 step; a foreach update
    # dispatches each op once for all of them. Those ranks already differ from the reference by
    # float rounding (their gradients are reduce-scattered); their equivalence tests compare
    # within tolerance.
    grouped = cuda or fully_sharded
    if name == "sgd":
        if betas is not None:
            raise ConfigError("--betas are AdamW's; drop them, or give --optimizer adamw")
        kind, options = torch.optim.SGD, {"lr": lr, "foreach": grouped, "momentum": momentum, "nesterov": nesterov}
    else:
        if momentum or nesterov:
            raise ConfigError("--momentum and --nesterov are SGD's; AdamW's first moment is its own (drop them, or "
                              "give --optimizer sgd)")
        kind, options = torch.optim.AdamW, {"lr": lr, "fused": True} if cuda else {"lr": lr, "foreach": grouped}
        options |= {"betas": betas} if betas is not None else {}
    if zero_group is not None and shard_masters:
        return ShardedMasters(params, kind, options, zero_group)
    if zero_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Each owner's updated parameters leave in one broadcast (its bucket, the parameters views
        # into it), not one per parameter: over gloo a broadcast per tensor added half again to a
        # small GPT's step, and the step model counts one gather of the bytes.
        return ZeroRedundancyOptimizer(params, optimizer_class=kind, process_group=zero_group,
                                       parameters_as_bucket_view=True, **options)
    return kind(params, **options)
