"""The loss a plan trains with is the model's only where the model file's loss is a mean over the
batch: the runtime averages its microbatches' losses, and the replicas' gradients, which gives the
batch's loss for a mean and only for a mean. A sum (``reduction="sum"``) trains with its gradients
divided by the number of microbatches and replicas, silently a smaller learning rate; a loss that
compares samples within the batch (in-batch negatives) trains on pairs within each microbatch only.

The capture tells which (`reduction_of`): ``loss_fn`` alone, on the output of the eager run it
makes anyway, for two samples against each one alone. No forward is run for it, so nothing of the
model (its buffers, its random draws, its training flags) is touched. `check_mean_loss` then judges
a plan by it: a sum is refused where the plan splits the batch, any other loss that is not the
batch's mean is warned of. Where the options already say that the batch will be split (a layout
given in full, a search free to choose microbatches and replicas), `autopart.passes.early_refusals`
refuses a sum right after the capture, before any op is timed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopart.ir.errors import ModelFileError
from autopart.ir.plan import Plan

__all__ = ["MEAN", "SUM", "OTHER", "UNKNOWN", "check_mean_loss", "reduction_of", "summed_loss_error"]

log = logging.getLogger("autopart")

MEAN, SUM, OTHER, UNKNOWN = "mean", "sum", "other", "unknown"


def reduction_of(loss_fn: Callable[[Any, Any], Any] | None, output: Any, target: Any) -> str:
    """How ``loss_fn`` reduces over the batch of ``output`` and ``target`` (batch first): `MEAN`
    where the loss of two samples is the mean of each one's, `SUM` where it is their sum, `OTHER`
    else; `UNKNOWN` where it cannot be told (no loss_fn: the model returns its loss; no tensor
    split along a batch). A batch of one sample is compared as that sample twice."""
    outputs = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    if loss_fn is None or not outputs or outputs[0].dim() == 0:
        return UNKNOWN
    batch = outputs[0].shape[0]

    def rows(value: Any, picked: list[int]) -> Any:
        def part(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
                t = t.detach()[picked]
                return t.float() if t.is_floating_point() else t  # 16-bit rounding is no reduction
            return t

        return pytree.tree_map(part, value)

    pair = [0, 1] if batch >= 2 else [0, 0]
    try:
        with torch.no_grad():
            whole = _scalar(loss_fn(rows(output, pair), rows(target, pair)))
            each = [_scalar(loss_fn(rows(output, [i]), rows(target, [i]))) for i in pair]
    except Exception:  # noqa: BLE001 - a loss that needs more samples than one: nothing to compare
        return UNKNOWN
    if whole is None or None in each:
        return UNKNOWN
    if _close(whole, sum(each) / 2):
        return MEAN
    return SUM if _close(whole, sum(each)) else OTHER


def check_mean_loss(plan: Plan, reduction: str, model_file: str) -> None:
    """Refuse a loss that sums over the batch where ``plan`` splits the batch (microbatches or
    replicas), in one line; warn of any other loss that is not the batch's mean."""
    schedule = plan.schedule
    pieces = schedule.global_batch_size // schedule.micro_batch_size
    if pieces == 1 or reduction in (MEAN, UNKNOWN):
        return
    split = f"the plan splits each batch of {schedule.global_batch_size} into {pieces} of {schedule.micro_batch_size}"
    if reduction == SUM:
        raise summed_loss_error(model_file, split, f"1/{pieces}")
    log.warning(f"the loss of {model_file} is not a mean over the batch (the loss of two samples is not the mean of "
                f"each one's): {split} and averages their losses, so it trains on another loss than the whole "
                "batch's (one that compares samples within the batch, or ignore_index counting unequally), and "
                "autopart verify, whose reference runs the whole batch, shows the difference")


def summed_loss_error(model_file: str, split: str, share: str, whole: str = "") -> ModelFileError:
    """The one-line refusal of a summed loss: ``split`` says how the batch is split, ``share`` what
    share of the model's gradients it would train with, ``whole`` another fix, where there is one."""
    return ModelFileError(
        f"the loss of {model_file} sums over the batch (the loss of two samples is the sum of each one's), and "
        f"{split} and averages their losses, so it would train with gradients {share} of the model's; make it "
        f"a mean over the batch (reduction='mean', or divide by the batch size){whole}"
    )


def _scalar(loss: Any) -> float | None:
    return float(loss.detach().double()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * max(abs(a), abs(b)) + 1e-6
