"""The optimizers that the generated programs and the single-process reference share."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from autopart.errors import ConfigError

__all__ = ["OPTIMIZERS", "make_optimizer"]

OPTIMIZERS = ("sgd", "adamw")


def make_optimizer(name: str, parameters: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    params = list(parameters)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        # foreach=False: the same per-tensor arithmetic on every rank and in the reference
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    raise ConfigError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")
