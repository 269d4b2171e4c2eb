"""The data-parallel gradient all-reduce, overlapped with the backward as DDP overlaps it.

A parameter's gradient is final on this rank once its stage's last weight-gradient action of
the step has run: the last B of the stage in the rank's action list, or, in a zero-bubble
schedule, its last W (I computes input gradients only). Its replicas' gradients can be summed
from then on, while the rank goes on with the actions after it; only what is still running
when the action list ends adds to the step.

The gradients are reduced in buckets, the same on every replica: per stage in the order their
gradients become final, each stage's parameters from its last to its first (the backward's
order), cut where a bucket reaches `FIRST_BUCKET_BYTES` (the first; small, so that the
reduction starts early) or `BUCKET_BYTES`, DDP's defaults. Inside a stage's last B, a hook on
each parameter's gradient accumulation marks it final as soon as autograd has written it, so a
bucket of the last layers is on the wire while the first layers' gradients are computed; W
writes its gradients by hand, and its stage's parameters are final when it returns. Buckets
are launched strictly in their order (``async_op=True``), so that every replica issues the
same collectives in the same order whatever order autograd runs in; `GradientReducer.wait`
waits for them all before the optimizer step and divides by the replicas (the mean loss over
the global batch, as each replica's loss is already the mean over its microbatches). A bucket's
gradients move into its flat tensor when it is launched, and stay there as views.

`plan_buckets` and `final_gradient_positions` (`autopart.ir.buckets`) are the rule the step
model counts too (`autopart.predict.reduction`): one definition of which bytes go when.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autopart.ir.actions import Action, Kind
from autopart.ir.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, Bucket, final_gradient_positions, plan_buckets
from autopart.runtime.device import Mark

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Bucket", "plan_buckets", "final_gradient_positions",
           "GradientReducer"]

class GradientReducer:
    """Launches each bucket's all-reduce over ``group`` as soon as its gradients are final.

    The executor calls `before` and `after` around every action of the rank's list; `wait`
    ends the step's reduction. ``orders``: per stage, the plan's order of its parameter names
    (forward order); parameters the plan does not name come after them, in the module's order.
    """

    def __init__(self, *, modules: dict[int, nn.Module], orders: dict[int, Sequence[str]],
                 actions: Sequence[Action], group: dist.ProcessGroup | None, size: int) -> None:
        self.group, self.size = group, size
        self.final_at = {p: s for s, p in final_gradient_positions(actions).items() if s in modules}
        missing = sorted(set(modules) - set(self.final_at.values()))
        assert not missing, f"stages {missing} have no backward in this rank's action list"
        self.parameters: dict[tuple[int, str], nn.Parameter] = {}
        stages = []
        for position in sorted(self.final_at):
            stage = self.final_at[position]
            held = {n: p for n, p in modules[stage].named_parameters() if p.requires_grad}
            names = [n for n in orders.get(stage, ()) if n in held] + [n for n in held if n not in orders.get(stage, ())]
            stages.append((stage, [(n, held[n].numel() * held[n].element_size()) for n in names]))
            self.parameters.update({(stage, n): held[n] for n in names})
        self.buckets = plan_buckets(stages)
        self.bucket_of = {(b.stage, n): i for i, b in enumerate(self.buckets) for n in b.names}
        for key, parameter in self.parameters.items():
            parameter.register_post_accumulate_grad_hook(lambda _, key=key: self._hooked(key))
        self.armed: int | None = None
        self.clock: Callable[[], Mark] = time.perf_counter
        """What marks a bucket's launch: the step's `StepTimer.mark` where the executor times it (on a
        GPU a CUDA event in the stream, as the actions' own marks; the host runs ahead of it)."""
        self._reset()

    def _reset(self) -> None:
        self.waiting = [set(b.names) for b in self.buckets]
        self.reduced = 0  # buckets launched this step
        self.in_flight: list[tuple[torch.Tensor, dist.Work]] = []
        self.launched_at: list[Mark] = []  # each bucket's launch this step, by `clock`

    def before(self, position: int, action: Action) -> None:
        """Arm the hooks for the stage whose last B this is: its gradients are final as written."""
        if action.kind is Kind.B and self.final_at.get(position) == action.stage:
            self.armed = action.stage

    def after(self, position: int, action: Action) -> None:
        """After a stage's last weight-gradient action every one of its gradients is final."""
        self.armed = None
        stage = self.final_at.get(position)
        if stage is not None:
            for key in [k for k in self.parameters if k[0] == stage]:
                self._ready(key)

    def _hooked(self, key: tuple[int, str]) -> None:
        if self.armed == key[0]:
            self._ready(key)

    def _ready(self, key: tuple[int, str]) -> None:
        self.waiting[self.bucket_of[key]].discard(key[1])
        while self.reduced < len(self.buckets) and not self.waiting[self.reduced]:
            self._launch(self.buckets[self.reduced])

    def _launch(self, bucket: Bucket) -> None:
        """All-reduce the bucket's gradients as one flat tensor per dtype (one, in practice). The
        gradients move into it and live there from then on (each ``.grad`` a view of it), as
        DDP's ``gradient_as_bucket_view``: the step holds one copy of its gradients, where a flat
        copy beside them, kept until the step's last bucket was reduced, doubled them."""
        self.launched_at.append(self.clock())
        held = [p for p in (self.parameters[bucket.stage, n] for n in bucket.names) if p.grad is not None]
        # none at all: no gradient reached these parameters on any replica (the same graph everywhere)
        for dtype in dict.fromkeys(p.grad.dtype for p in held):
            members = [p for p in held if p.grad.dtype == dtype]
            flat = torch.cat([p.grad.reshape(-1) for p in members])
            offset = 0
            for parameter in members:
                parameter.grad = flat[offset : offset + parameter.numel()].view_as(parameter)
                offset += parameter.numel()
            self.in_flight.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        self.reduced += 1

    def wait(self) -> None:
        """Wait for every bucket's all-reduce and take the mean (in the gradients, views of the buckets)."""
        assert self.reduced == len(self.buckets), "a stage's last backward did not run"
        for flat, work in self.in_flight:
            work.wait()
            flat /= self.size
        self._reset()
