"""How a stage runs its forward: in the plan's precision, with the plan's activation recompute.

Precision (``Plan.dtype``). With ``bf16`` the forward runs under
``torch.autocast(device type, torch.bfloat16)``: the parameters stay fp32 (the master weights
that the optimizer updates), autocast casts them per forward, their gradients come out fp32,
and so the all-reduces of tied and data-parallel gradients run in fp32. The tensors sent to the
next stage are whatever autocast made (the plan's stage outputs say which dtype), and the
gradients sent back have the same dtypes.

Recompute (``StagePlan.recompute``, see `autopart.passes.recompute`). ``full`` runs the forward under
``torch.utils.checkpoint`` (non-reentrant): only the stage's arguments are kept, and the
forward runs again in backward. ``selective`` does the same with
``create_selective_checkpoint_contexts(selective_policy)``: the outputs of matrix products and
attention are kept in F and handed back, not recomputed, when the forward runs again.

With a whole backward (B, in GPipe, 1F1B, interleaved) autograd's backward through the
checkpoint recomputes, once. Zero-bubble schedules split the backward into I and W
(`autopart.runtime.backward`): two or more autograd calls, and non-reentrant checkpoint
recomputes once per call, so the forward would run again at I and again at W (once per group of
parameters); under selective recompute the second recompute fails outright ("Trying to backward
an extra time"), since the first spent the kept outputs. For a split backward the stage
therefore rebuilds the microbatch's graph itself, once, at I: it runs the forward again with
autograd recording, on the arguments that F kept, with F's random-number state and (selective)
the outputs F kept, through the very contexts that the checkpoint used in F. I and W then run
on that graph as on a stage without recompute. Its activations live from I to W.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopart.ir.tensors import precision
from autopart.ir.recompute import keeps_output

__all__ = ["StageForward", "Rebuild", "selective_policy"]


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of the compute-heavy ops (`autopart.passes.recompute.keeps_output`), recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if keeps_output(func) else CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(kw_only=True)
class Rebuild:
    """What F of a recomputing stage keeps for a split backward to rebuild the graph from, once."""

    args: tuple[Any, ...]
    rng_states: tuple[torch.Tensor, torch.Tensor | None]  # the CPU generator's, the accelerator's
    kept_outputs: contextlib.AbstractContextManager  # selective: hands back the outputs F kept


class StageForward:
    """Calls a stage module in the plan's precision, recomputing as the plan says."""

    def __init__(self, module: nn.Module, *, recompute: str, dtype: str, device: torch.device, split_backward: bool):
        self.module = module
        self.recompute = recompute
        self.dtype = dtype
        self.device = device
        self.split_backward = split_backward

    def _call(self, *args: Any) -> Any:
        with precision(self.dtype, self.device.type):
            return self.module(*args)

    def __call__(self, *args: Any) -> tuple[Any, Rebuild | None]:
        """F: the stage's outputs, and what a split backward rebuilds its graph from (else None)."""
        if self.recompute == "none":
            return self._call(*args), None
        if not self.split_backward:
            context_fn = (
                functools.partial(create_selective_checkpoint_contexts, selective_policy)
                if self.recompute == "selective"
                else _no_contexts
            )
            return checkpoint(self._call, *args, use_reentrant=False, context_fn=context_fn), None
        selective = self.recompute == "selective"
        contexts = create_selective_checkpoint_contexts(selective_policy) if selective else _no_contexts()
        rebuild = Rebuild(args=args, rng_states=self._rng_states(), kept_outputs=contexts[1])
        out = checkpoint(self._call, *args, use_reentrant=False, context_fn=lambda: contexts)
        return out, rebuild

    def rebuild(self, kept: Rebuild) -> Any:
        """The microbatch's outputs again, with the whole autograd graph that F did not keep."""
        cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if cuda else []), torch.enable_grad():
            cpu_state, device_state = kept.rng_states
            torch.set_rng_state(cpu_state)
            if device_state is not None:
                torch.cuda.set_rng_state(device_state, self.device)
            with kept.kept_outputs:
                return self._call(*kept.args)

    def _rng_states(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        device_state = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), device_state


def _no_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), contextlib.nullcontext()
