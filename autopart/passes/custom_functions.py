"""A model's own ``torch.autograd.Function``: torch.fx traces its forward into the graph like any
other code and keeps nothing of its backward, so the stages would differentiate the forward's ops
instead (a straight-through estimator's ``round`` then passes no gradient at all); torch.export
does the same. The capture notes each such Function that the model's eager run applies
(`used_functions`), and which module applies it where fx traces it (`traced_functions`); where
one was, it compares the graph's parameter gradients with the model's own
(`check_same_gradients`): a Function whose backward is its forward's derivative trains alike
either way; one whose backward is its own is refused, with the ways out: ``--leaf`` on the
module that calls it (the stages then call it as the model does), or the gradient written with
the forward's own ops."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx
from torch.func import functional_call

from autopart.ir.errors import ModelFileError
from autopart.ir.model_file import ModelSpec, eager_loss
from autopart.passes.capture_checks import Example, same_draws

__all__ = ["used_functions", "traced_functions", "check_same_gradients"]


@contextlib.contextmanager
def _patched_apply(record) -> Iterator[None]:
    """torch.autograd.Function.apply with ``record(cls, args, kwargs)`` called first, put back after."""
    original = torch.autograd.Function.__dict__["apply"]  # the classmethod itself: subclasses bind it

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch."):  # torch's own (a reentrant checkpoint's) are its forward's
            record(cls, args, kwargs)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


@contextlib.contextmanager
def used_functions() -> Iterator[set[str]]:
    """The names of the model's own autograd.Functions that the body applies (the eager run of
    the model and its loss: whichever capture follows, fx or export, traces them alike)."""
    names: set[str] = set()
    with _patched_apply(lambda cls, args, kwargs: names.add(cls.__name__)):
        yield names


@contextlib.contextmanager
def traced_functions(tracer: fx.Tracer) -> Iterator[dict[str, str]]:
    """While ``tracer`` traces: the class of the module that applied each of the model's own
    autograd.Functions to a traced value, by the Function's name ("" at the top)."""
    callers: dict[str, str] = {}

    def record(cls, args, kwargs) -> None:
        if any(isinstance(a, fx.Proxy) for a in (*args, *kwargs.values())):
            caller = next(reversed(tracer.module_stack.values()), None) if tracer.module_stack else None
            callers.setdefault(cls.__name__, caller[1].__name__ if caller and isinstance(caller[1], type) else "")

    with _patched_apply(record):
        yield callers


def _close(ours: torch.Tensor | None, traced: torch.Tensor | None) -> bool:
    """Whether two gradients of a parameter agree as far as their dtype's rounding (a 16-bit
    model's backward formulas round apart): by the norm of their difference."""
    if ours is None or traced is None:
        return ours is None and traced is None
    tolerance = 2e-2 if ours.dtype in (torch.bfloat16, torch.float16) else 1e-4
    difference = float((ours.double() - traced.double()).norm())
    return difference <= tolerance * max(float(ours.double().norm()), float(traced.double().norm())) + 1e-12


def check_same_gradients(spec: ModelSpec, module: fx.GraphModule, example: Example, used: set[str],
                         callers: dict[str, str]) -> None:
    """Refuse a graph whose parameter gradients on ``example`` are not the model's, where the
    model applies its own autograd.Functions (``used``); the graph holds the model's own
    parameters. ``callers``: the module class that applies each, where the fx trace saw it. Each
    parameter's gradient is left as it was, and each run writes copies of the buffers (as
    `autopart.passes.loss_gradient`'s confirming forward does)."""
    if not used:
        return
    trained = [p for p in spec.module.parameters() if p.requires_grad]
    kept = [p.grad for p in trained]

    def gradients(run, buffers: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
        for p in trained:
            p.grad = None
        with same_draws():
            loss = run({name: b.clone() for name, b in buffers.items()})
        if loss.requires_grad:  # else none flows (a Function whose forward detaches): told apart below
            loss.backward()
        return [p.grad for p in trained]

    try:
        ours = gradients(lambda copies: eager_loss(spec, example.inputs, example.target, copies),
                         dict(spec.module.named_buffers()))
        traced = gradients(lambda copies: functional_call(module, copies, example.graph_args, strict=False,
                                                          tie_weights=False), dict(module.named_buffers()))
    finally:
        for p, grad in zip(trained, kept):
            p.grad = grad
    if all(_close(a, b) for a, b in zip(ours, traced)):
        return
    names = sorted(used)
    leaves = {callers.get(name, "") for name in names} - {"", type(spec.module).__name__}
    fix = (f"keep the module that calls it opaque with --leaf {leaves.pop()}, or " if len(leaves) == 1 and
           all(callers.get(name) for name in names) else "")
    raise ModelFileError(
        f"the model's autograd.Function {names[0]}{f' (or one of {len(names) - 1} more)' if names[1:] else ''} has a "
        "backward of its own, which a traced graph cannot keep (torch.fx and torch.export trace its forward alone, "
        f"and the gradients come out otherwise); {fix}write its gradient with the forward's own ops (a "
        "straight-through estimator: x + (x.round() - x).detach())"
    )
