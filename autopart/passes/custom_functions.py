"""A model's own ``torch.autograd.Function``: torch.fx traces its forward into the graph like any
other code and keeps nothing of its backward, so the stages would differentiate the forward's ops
instead (a straight-through estimator's ``round`` then passes no gradient at all). torch.export
does the same. The capture notes each such Function that the trace ran (`traced_functions`) and,
where one was, compares the graph's parameter gradients with the model's own
(`check_same_gradients`): a Function whose backward is its forward's derivative trains alike
either way; one whose backward is its own is refused, with the way out, ``--leaf`` on the module
that calls it, which the stages then call as the model does."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx

from autopart.ir.errors import ModelFileError
from autopart.ir.model_file import ModelSpec, eager_loss
from autopart.passes.capture_checks import Example, same_draws

__all__ = ["traced_functions", "check_same_gradients"]


@contextlib.contextmanager
def traced_functions(tracer: fx.Tracer) -> Iterator[dict[str, str]]:
    """While ``tracer`` traces: each autograd.Function of the model's (not torch's own, such as
    a reentrant checkpoint's, whose backward is its forward's) applied to a traced value, by name,
    with the class of the module that applied it ("" at the top)."""
    functions: dict[str, str] = {}
    original = torch.autograd.Function.__dict__["apply"]  # the classmethod itself: subclasses bind it

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch.") and any(isinstance(a, fx.Proxy) for a in (*args, *kwargs.values())):
            caller = next(reversed(tracer.module_stack.values()), None) if tracer.module_stack else None
            functions.setdefault(cls.__name__, caller[1].__name__ if caller and isinstance(caller[1], type) else "")
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield functions
    finally:
        torch.autograd.Function.apply = original


def check_same_gradients(spec: ModelSpec, module: fx.GraphModule, example: Example, functions: dict[str, str]) -> None:
    """Refuse a graph whose parameter gradients on ``example`` are not the model's, where the
    trace ran ``functions`` (`traced_functions`); the graph holds the model's own parameters. Each
    parameter's gradient, and the buffers, are left as they were."""
    if not functions:
        return
    trained = [p for p in spec.module.parameters() if p.requires_grad]
    kept = [p.grad for p in trained]
    buffers = {name: b.clone() for name, b in spec.module.named_buffers()}

    def gradients(run) -> list[torch.Tensor | None]:
        for p in trained:
            p.grad = None
        with same_draws():
            loss = run()
        if loss.requires_grad:  # else none flows (a Function whose forward detaches): told apart below
            loss.backward()
        with torch.no_grad():
            for name, b in spec.module.named_buffers():
                b.copy_(buffers[name])
        return [p.grad for p in trained]

    try:
        ours = gradients(lambda: eager_loss(spec, example.inputs, example.target))
        traced = gradients(lambda: module(*example.graph_args))
    finally:
        for p, grad in zip(trained, kept):
            p.grad = grad
    if all((a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-4, atol=1e-6))
           for a, b in zip(ours, traced)):
        return
    name, caller = next(iter(functions.items()))
    if caller and caller != type(spec.module).__name__:
        fix = f"keep the module that calls it opaque with --leaf {caller}"
    else:  # the model's own forward calls it: the whole model cannot be a leaf
        fix = "call it in a module of its own and keep that module opaque with --leaf"
    raise ModelFileError(
        f"the model's autograd.Function {name} has a backward of its own, which a traced graph cannot keep (torch.fx "
        f"and torch.export trace its forward alone, and the gradients come out otherwise); {fix}, whose forward the "
        "stages then run as the model does"
    )
