"""The optimizers that the generated programs and the single-process reference share."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from autopart.errors import ConfigError

__all__ = ["OPTIMIZERS", "make_optimizer"]

OPTIMIZERS = ("sgd", "adamw")


def make_optimizer(
    name: str,
    parameters: Iterable[torch.nn.Parameter],
    lr: float,
    *,
    zero_group: torch.distributed.ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """SGD or AdamW; with ``zero_group``, its state sharded over that group (ZeRO-1)."""
    params = list(parameters)
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")
    # foreach=False: the same per-tensor arithmetic on every rank and in the reference
    kind, options = (torch.optim.SGD, {"lr": lr}) if name == "sgd" else (torch.optim.AdamW, {"lr": lr, "foreach": False})
    if zero_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=kind, process_group=zero_group, **options)
    return kind(params, **options)
