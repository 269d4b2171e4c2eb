"""A loss that no trained parameter feeds takes no gradient: its programs would fail at their first
backward ('does not require grad'), or train nothing. It is refused right after the capture, which
needs no timing: the op timing that comes next runs every op's kernels (minutes on a large model),
and costing a model that cannot train is work thrown away.

The capture's rule is `autopart.passes.grad_flow`'s, over the graph without its values, and the
loss's dtype (an integer or boolean loss takes no gradient whatever feeds it). The rule can miss a
gradient that autograd follows through an alias written in place; so where it finds none, one
forward with gradients on decides (autograd's own verdict), on copies of the buffers so that the
model is left as it was. A loss the rule passes but that takes no gradient all the same (an integer
made in the middle, as ``argmax``) is refused by the annotation, which has every value
(`autopart.passes.annotate`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.func import functional_call

from autopart.ir.errors import ModelFileError
from autopart.passes.capture_checks import same_draws
from autopart.passes.grad_flow import GradientFlow, trainable_parameters

__all__ = ["check_loss_takes_gradient", "no_gradient_error"]


def no_gradient_error(model_file: str) -> ModelFileError:
    """The one-line refusal of a loss that takes no gradient from any trained parameter."""
    return ModelFileError(
        f"the loss of {model_file} takes no gradient from any parameter that trains (the model has no "
        "trainable parameter, or the loss is detached or an integer), so training could change nothing; return "
        "a floating-point loss computed from the model's output, with requires_grad on for what should train"
    )


def check_loss_takes_gradient(module: fx.GraphModule, args: tuple[Any, ...], loss: torch.Tensor,
                              model_file: str) -> None:
    """Refuse the training graph ``module`` where its loss (``loss``: the eager loss, for its
    dtype) takes no gradient from a trained parameter; ``args``: the graph's example inputs, on
    the model's device, for the forward that confirms what the rule finds."""
    if not (loss.is_floating_point() or loss.is_complex()):
        raise no_gradient_error(model_file)
    flow = GradientFlow(trainable_parameters(module))
    for node in module.graph.nodes:
        if flow.visit(node) and node.op == "output":
            return
    buffers = {name: b.clone() for name, b in module.named_buffers(remove_duplicate=False)}
    with torch.enable_grad(), same_draws():
        ran = functional_call(module, buffers, args, strict=False, tie_weights=False)
    if not (isinstance(ran, torch.Tensor) and ran.requires_grad):
        raise no_gradient_error(model_file)
