"""How a stage runs its forward: in the plan's precision, with the plan's activation recompute.

Precision (``Plan.dtype``, `autopart.ir.tensors.DTYPES`). Both bf16 precisions run the forward
under ``torch.autocast(device type, torch.bfloat16)``, so the ops on autocast's fp32 list
(softmax, norms, losses) run in fp32 as ever. The module's parameters are always the fp32
master weights that the optimizer updates, checkpoints save and ``consolidate`` gathers (under
``bf16`` with ZeRO-1, only the replica's share of them holds fp32 data; see below).

- ``bf16-autocast``: the forward reads the fp32 parameters and autocast casts them to bf16 in
  every forward and every recompute.
- ``bf16``: `begin_step` makes one bf16 working copy of each parameter per step, after the
  optimizer's step (Megatron-LM's ``params.bf16`` and FSDP2's ``MixedPrecisionPolicy(param_dtype)``);
  the forward calls the module on those copies (``torch.func.functional_call``) and autocast finds
  nothing left to cast. The copy is made with autograd recording, once: every microbatch's bf16
  weight gradient flows back through that one cast into the fp32 parameter's ``.grad``, so
  gradients are accumulated over microbatches in fp32 (Megatron's ``main_grad``) and tied and
  data-parallel sums run on fp32 gradients (its ``accumulate_allreduce_grads_in_fp32``). A cast
  saves no tensor for backward, so the one cast serves every microbatch's backward. Under ZeRO-1
  the fp32 masters are sharded over the data-parallel replicas and every replica holds the
  weights in bf16 (Megatron-LM's distributed optimizer, `autopart.runtime.sharded_masters`): the
  working copy is that bf16 weight, whose backward accumulates into the fp32 ``.grad`` alike.
  Under ZeRO-2/3 FSDP holds the parameters and casts them itself (`autopart.runtime.fully_sharded`).

The tensors sent to the next stage are whatever the forward made (the plan's stage outputs say
which dtype), and the gradients sent back have the same dtypes.

Recompute (``StagePlan.recompute``, see `autopart.passes.recompute`). ``full`` with a whole
backward checkpoints each repeated layer by itself, as Megatron-LM's full recompute and
llm-foundry's activation checkpointing do: each call of a stage method that ``layer_calls``
lists runs under ``torch.utils.checkpoint`` (non-reentrant), which keeps the layer's inputs, and
the backward runs the layers again one at a time, so it holds one layer's activations rather
than the stage's. The rest of the stage (embedding, head, a layer written inline) keeps what
autograd saves. ``stage``, and ``full`` in a stage without layer methods or under a split
backward (below), runs the whole forward under one checkpoint, which keeps the stage's
arguments. A layer's
recompute casts its working weights again (they are parameters of the stage only inside
``functional_call``, which has returned by the time the backward runs); under ZeRO-3 the
checkpoint runs inside the layer's FSDP unit, which gathers the weights for the recompute.
``selective`` runs the forward under ``create_selective_checkpoint_contexts(selective_policy)``:
the outputs of matrix products and attention are kept in F and handed back, not recomputed,
when the forward runs again.

Random draws (dropout): the executor seeds the generators before each F with
`autopart.runtime.draws.draw_seed` of train.py's ``--seed``, the step, the replica, the
microbatch and the stage, so F draws the same whatever the schedule's order, the process or a
resume, and a recompute that replays F's state draws F's numbers again.

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
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopart.ir.tensors import precision, working_dtype
from autopart.runtime.fully_sharded import is_sharded
from autopart.runtime.sharded_masters import working_weight
from autopart.ir.recompute import keeps_output

__all__ = ["StageForward", "Rebuild", "selective_policy", "working_copies", "NoDropout", "buffers_kept"]


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of the compute-heavy ops (`autopart.passes.recompute.keeps_output`), recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if keeps_output(func) else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def buffers_kept(buffers: list[torch.Tensor]) -> Iterator[None]:
    """Put the buffers back as they were on leaving: a captured graph has its BatchNorms' training
    flag baked in, so a held-out forward (an evaluation) would move their running statistics by
    the held-out data, and the model trained with --eval-every would not be the one trained
    without; the reference evaluates alike. The buffers are those a forward writes
    (`autopart.runtime.buffer_updates.BufferUpdates.tracked_buffers`): a copy of any other would
    be memory spent on nothing."""
    kept = [(buffer, buffer.detach().clone()) for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                # unversioned, as `BufferUpdates` writes them: autograd saves BatchNorm's running
                # statistics for a backward that torch may run after this (its inference of a
                # stage's gradient shapes follows the forward's, each kept apart)
                buffer.data.copy_(value)


class NoDropout(TorchFunctionMode):
    """Dropouts pass their input through: a captured graph has its dropouts' training flag baked
    in, so evaluating it (held-out losses) would drop units; the reference evaluates alike. It
    sees torch functions, which the capture makes of an exported graph's aten dropouts too, and
    reaches inside the composite ones that draw (attention, ``nn.MultiheadAttention``'s forward)
    by their ``dropout_p``."""

    DROPOUTS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                          F.feature_alpha_dropout, torch.dropout, torch.dropout_, torch.alpha_dropout,
                          torch.alpha_dropout_, torch.feature_dropout, torch.feature_dropout_,
                          torch.feature_alpha_dropout, torch.feature_alpha_dropout_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            args, kwargs = args[:3], {**kwargs, **dict(zip(_SDPA_AFTER_VALUES, args[3:])), "dropout_p": 0.0}
        elif func is F.multi_head_attention_forward:  # its dropout runs inside it, where this mode is off
            args, kwargs = args[:10], {**kwargs, **dict(zip(_MHA_FROM_DROPOUT, args[10:])), "dropout_p": 0.0}
        return func(*args, **kwargs)


_SDPA_AFTER_VALUES = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MHA_FROM_DROPOUT = tuple(inspect.signature(F.multi_head_attention_forward).parameters)[10:]  # dropout_p first


def working_copies(module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every floating parameter of ``module`` cast to ``dtype``, by every name it has (a tied
    parameter's names share one copy), differentiable back to the parameter while grad is on
    (under ZeRO-1 the bf16 weight it holds, `autopart.runtime.sharded_masters`)."""
    made: dict[int, torch.Tensor] = {}
    copies = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) not in made:
            made[id(parameter)] = working_weight(parameter, dtype)
        copies[name] = made[id(parameter)]
    return copies


@dataclass(kw_only=True)
class Rebuild:
    """What F of a recomputing stage keeps for a split backward to rebuild the graph from, once."""

    args: tuple[Any, ...]
    rng_states: tuple[torch.Tensor, torch.Tensor | None]  # the CPU generator's, the accelerator's
    kept_outputs: contextlib.AbstractContextManager  # selective: hands back the outputs F kept


class StageForward:
    """Calls a stage module in the plan's precision, recomputing as the plan says."""

    def __init__(self, module: nn.Module, *, recompute: str, dtype: str, device: torch.device, split_backward: bool,
                 dropout: bool = True, around_recompute: contextlib.AbstractContextManager | None = None):
        self.module = module
        # entered around each checkpoint's recompute, which a caller that does not run the
        # backward itself cannot see (`autopart.runtime.buffer_updates.BufferUpdates.recompute`)
        self.around_recompute = around_recompute
        self.dropout = dropout  # False: every dropout passes its input, in F and in any recompute (`NoDropout`)
        self.recompute = recompute
        self.dtype = dtype
        self.device = device
        self.split_backward = split_backward
        self.working: dict[str, torch.Tensor] | None = None  # this step's working weights, by name (begin_step)
        layers = _layer_calls(module) if recompute == "full" and not split_backward else {}
        self.layered = bool(layers)  # each layer its own checkpoint; the stage's forward under none
        self._caller = _MethodCall(module) if layers else None
        self._layer_working: dict[int, dict[str, torch.Tensor]] = {}  # per layer module, its working copies
        self._stage_working: dict[str, torch.Tensor] = {}
        self._layer_paths = tuple(path for paths in layers.values() for path in paths)
        for method in _layer_calls(module):
            if getattr(module.__dict__.get(method), "checkpoints_layers", False):  # an earlier StageForward's
                del module.__dict__[method]
            if layers:  # before FSDP routes the method through a layer's unit (its hooks outside)
                wrapped = functools.partial(self._checkpointed_layer, getattr(module, method))
                wrapped.checkpoints_layers = True
                setattr(module, method, wrapped)

    def begin_step(self) -> None:
        """Cast this step's working copies of the weights from the masters (``bf16``), once; the
        optimizer has stepped since the last ones. Without autograd (evaluation) they carry no graph."""
        lower = working_dtype(self.dtype)
        sharded = any(is_sharded(p) for p in self.module.parameters())  # FSDP casts what it gathers
        self.working = working_copies(self.module, lower) if lower is not None and not sharded else {}
        self._layer_working = self._per_layer(self.working) if self.layered and self.working else {}
        # a layer that `layer_calls` does not list (a stage written before it) runs the same method
        self._stage_working = {f"stage.{n}": t for n, t in self.working.items()} if self._layer_working else {}

    def _call(self, *args: Any) -> Any:
        if self.working is None:  # a caller that runs no steps (one forward, a profile): the weights as they are
            self.begin_step()
        with precision(self.dtype, self.device.type), contextlib.nullcontext() if self.dropout else NoDropout():
            if self.working:
                return torch.func.functional_call(self.module, self.working, args)
            return self.module(*args)

    def __call__(self, *args: Any) -> tuple[Any, Rebuild | None]:
        """F: the stage's outputs, and what a split backward rebuilds its graph from (else None)."""
        if self.recompute == "none" or self.layered:
            return self._call(*args), None
        if not self.split_backward:
            context_fn = (
                functools.partial(create_selective_checkpoint_contexts, selective_policy)
                if self.recompute == "selective"
                else _no_contexts
            )
            return checkpoint(self._call, *args, use_reentrant=False, context_fn=self._around(context_fn)), None
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

    def _checkpointed_layer(self, body: Any, *inputs: Any, **kwargs: Any) -> Any:
        """A layer method's call (``body(*inputs, layer)``, the layer maybe by keyword, as FSDP's
        unit passes it) under its own checkpoint."""
        return checkpoint(self._layer, body, *inputs, use_reentrant=False, context_fn=self._around(_no_contexts),
                          **kwargs)  # fmt: skip

    def _around(self, context_fn: Any) -> Any:
        """``context_fn`` with `around_recompute` entered around its recompute context."""
        if self.around_recompute is None:
            return context_fn

        def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
            forward, recompute = context_fn()
            return forward, _Together(self.around_recompute, recompute)

        return contexts

    def _layer(self, body: Any, *inputs: Any, **kwargs: Any) -> Any:
        """One layer's forward, in F and again in its recompute: the checkpoint restores autocast
        and the random state itself, not the working weights nor `NoDropout`, which this enters."""
        layer = kwargs["layer"] if "layer" in kwargs else inputs[-1]
        weights = self._layer_working.get(id(layer), self._stage_working)
        with precision(self.dtype, self.device.type), contextlib.nullcontext() if self.dropout else NoDropout():
            if weights:
                # tie_weights=False: a tied weight's every name is in ``weights``, and the default
                # would walk the stage's every parameter on each layer's call to find them
                return torch.func.functional_call(self._caller, weights, (body, *inputs), kwargs, tie_weights=False)
            return body(*inputs, **kwargs)

    def _per_layer(self, working: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
        """Per layer module (by id), the working copies its method may read, named as `_MethodCall`
        sees them: the layer's own and the stage's outside every layer (not other layers', so
        that each call swaps a layer's worth of tensors, not the stage's)."""
        outside = {name: t for name, t in working.items()
                   if not name.startswith(tuple(f"{p}." for p in self._layer_paths))}
        found = {}
        for path in self._layer_paths:
            own = {name: t for name, t in working.items() if name.startswith(f"{path}.")}
            found[id(self.module.get_submodule(path))] = {f"stage.{n}": t for n, t in (outside | own).items()}
        return found

    def _rng_states(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        device_state = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), device_state


def _layer_calls(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Per layer method of a stage, the layers it is called for (``layer_calls``; a stage file
    written before it names only its FSDP units' layers, ``layer_methods``)."""
    stage = type(module)
    return getattr(stage, "layer_calls", None) or getattr(stage, "layer_methods", {})


def _no_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), contextlib.nullcontext()


class _Together(contextlib.AbstractContextManager):
    """Contexts entered in order and left in reverse, again at each entry (a checkpoint enters
    its recompute context once per backward that recomputes), nested too."""

    def __init__(self, *contexts: contextlib.AbstractContextManager):
        self.contexts = contexts
        self.entered: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context)
            self.entered.append(stack.pop_all())

    def __exit__(self, *exc: Any) -> bool | None:
        return self.entered.pop().__exit__(*exc)


class _MethodCall(nn.Module):
    """Calls a function with the stage as a child, so that ``torch.func.functional_call`` on it
    swaps the stage's parameters (by ``stage.``-prefixed names) for a call of one of its methods."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)
