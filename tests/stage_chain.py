"""Emitted stage modules chained in one process, as the pipeline chains them across ranks."""

from __future__ import annotations

import torch
from torch import nn


def chained_loss(stages: list[nn.Module], plan, inputs: tuple, target) -> torch.Tensor:
    """The loss of one batch through ``stages`` (loaded as a rank loads them), each fed the
    tensors its plan says it receives and reads from the batch."""
    values = dict(zip(plan.graph_inputs, (*inputs, target)))
    for stage, module in zip(plan.stages, stages):
        received = [values[name] for name, _ in stage.inputs] + [values[name] for name in stage.batch_inputs]
        produced = module(*received)
        names = [name for name, _ in stage.outputs] or ["loss"]
        values.update(zip(names, produced if isinstance(produced, tuple) else (produced,)))
    return values["loss"]
