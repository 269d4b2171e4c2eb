"""The loss a plan trains with is the model's only where the model file's loss is a mean over the
batch: the runtime averages its microbatches' losses, and the replicas' gradients, which gives the
batch's loss for a mean and only for a mean. A sum (``reduction="sum"``) trains with its gradients
divided by the number of microbatches and replicas, silently a smaller learning rate; a loss that
compares samples within the batch (in-batch negatives) trains on pairs within each microbatch only.

Checked on the example batch in eval mode (no dropout; BatchNorm on its running statistics), so
that the halves' losses differ from the whole's through the loss's reduction alone, with the
model's training flags, buffers and random state put back afterwards."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopart.ir.errors import ModelFileError
from autopart.ir.model_file import ModelSpec, eager_loss, is_meta
from autopart.ir.plan import Plan
from autopart.passes.capture_checks import same_draws

__all__ = ["check_mean_loss"]

log = logging.getLogger("autopart")

SAMPLES = 2
"""The example batch the check splits in two: one sample each, so any reduction shows."""


def check_mean_loss(spec: ModelSpec, plan: Plan) -> None:
    """Refuse a loss that sums over the batch where ``plan`` splits the batch (microbatches or
    replicas), in one line; warn of any other loss that is not the batch's mean."""
    schedule = plan.schedule
    pieces = schedule.global_batch_size // schedule.micro_batch_size
    if pieces == 1 or spec.module is None or is_meta(spec.module):
        return
    inputs, target = spec.example(SAMPLES)
    if any(not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != SAMPLES for t in inputs):
        return  # not split along a first dimension of the batch: nothing to compare
    with _evaluated(spec.module):
        whole = _loss(spec, inputs, target, slice(None))
        halves = [_loss(spec, inputs, target, slice(i, i + 1)) for i in range(SAMPLES)]
    if whole is None or any(h is None for h in halves):
        return
    mean, total = sum(halves) / SAMPLES, sum(halves)
    if _close(whole, mean):
        return
    name = spec.path.name
    split = f"the plan splits each batch of {schedule.global_batch_size} into {pieces} of {schedule.micro_batch_size}"
    if _close(whole, total):
        raise ModelFileError(
            f"the loss of {name} sums over the batch (a batch of {SAMPLES} gives {whole:.6g}, the sum of its samples' "
            f"{', '.join(f'{h:.6g}' for h in halves)}), and {split} and averages their losses, so it would train with "
            f"gradients 1/{pieces} of the model's; make it a mean over the batch (reduction='mean', or divide by the "
            "batch size)"
        )
    log.warning(f"the loss of {name} is not a mean over the batch (a batch of {SAMPLES} gives {whole:.6g}, its samples "
                f"{', '.join(f'{h:.6g}' for h in halves)} alone): {split} and averages their losses, so it trains on "
                "another loss than the whole batch's (one that compares samples within the batch, or ignore_index "
                "counting unequally), and autopart verify, whose reference runs the whole batch, shows the difference")


def _loss(spec: ModelSpec, inputs: tuple[torch.Tensor, ...], target: Any, rows: slice) -> float | None:
    """The loss of the example's ``rows``; None where the target is not split alike (no batch dimension)."""
    def part(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == SAMPLES:
            return value[rows]
        return value

    if target is not None and not any(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == SAMPLES
                                      for t in pytree.tree_leaves(target)):
        return None
    try:
        with torch.no_grad(), same_draws():
            loss = eager_loss(spec, tuple(part(t) for t in inputs), pytree.tree_map(part, target))
    except Exception:  # noqa: BLE001 - a model that needs more samples than one: nothing to compare
        return None
    return float(loss.detach().float()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * max(abs(a), abs(b)) + 1e-6


@contextlib.contextmanager
def _evaluated(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode, its buffers (a counter that forward advances) and each submodule's
    training flag as they were afterwards."""
    flags = [(m, m.training) for m in module.modules()]
    buffers = [(b, b.clone()) for b in module.buffers()]
    module.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training
        with torch.no_grad():
            for b, kept in buffers:
                b.copy_(kept)
