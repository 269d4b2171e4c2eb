"""The single-process reference: the original model trained eagerly on the same batches.

The generated programs must match it: the same per-step losses and the same final parameters,
to float tolerance. Tests and ``autopart verify`` compare against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from autopart.capture import eager_loss, load_model_file
from autopart.plan import load_plan
from autopart.runtime.data import global_batches, model_file
from autopart.runtime.optim import make_optimizer
from autopart.runtime.shards import load_stage_weights

__all__ = ["ReferenceRun", "initial_weights", "train_reference"]


@dataclass(frozen=True, kw_only=True)
class ReferenceRun:
    losses: list[float]
    parameters: dict[str, torch.Tensor]  # by the names the stages use


def initial_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    """The union of every stage's initial weights, whole, by their names in the original model."""
    weights: dict[str, torch.Tensor] = {}
    for stage in load_stage_weights(load_plan(out_dir / "plan.json"), out_dir / "weights").values():
        weights.update(stage)
    return weights


def train_reference(out_dir: str | Path, *, steps: int, lr: float, optimizer: str, seed: int = 0) -> ReferenceRun:
    out_dir = Path(out_dir)
    plan = load_plan(out_dir / "plan.json")
    spec = load_model_file(model_file(out_dir, plan))
    model = spec.module
    assert model is not None
    weights = initial_weights(out_dir)
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for name, value in weights.items():
            named[name].copy_(value)
    params = [p for p in model.parameters()]
    opt = make_optimizer(optimizer, params, lr)
    data = global_batches(spec, plan.schedule.global_batch_size, seed)
    losses = []
    for _ in range(steps):
        inputs, target = next(data)
        loss = eager_loss(spec, inputs, target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    final = {name: named[name].detach().clone() for name in weights}
    return ReferenceRun(losses=losses, parameters=final)
