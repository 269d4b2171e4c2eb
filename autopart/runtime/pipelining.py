"""An autopart plan from your own training loop, in ``torch.distributed.pipelining``'s terms.

    import torch.distributed as dist
    from autopart.runtime.pipelining import build_stages

    dist.init_process_group("gloo")                  # under torchrun, as for any torch pipeline
    pipeline = build_stages("out")                   # this rank's stages, with their weights
    schedule = pipeline.schedule()                   # ScheduleGPipe, Schedule1F1B, ... as the plan says
    optimizer = torch.optim.AdamW(pipeline.parameters() or [{"params": []}])  # a stage of the loss alone has none
    for inputs, target in pipeline.batches(seed=0):
        losses = []
        schedule.step(**pipeline.step_inputs(inputs, target), losses=losses)
        pipeline.reduce_gradients()                  # tied copies summed, replicas averaged, buffers settled
        optimizer.step(); optimizer.zero_grad()

(``examples/pipelining_loop.py`` is this loop, whole.) The stages are autopart's generated
modules (``OUT/stages/stage_<k>.py``, weights from ``OUT/weights`` sliced for this tensor-parallel
rank), each wrapped so that torch can drive it:

- the batch values a stage reads (token ids on the first stage, the target on the last) travel
  as keyword arguments ``batch_<name>``, which torch splits into microbatches and hands to
  every stage; a stage takes its own and ignores the rest, so nothing extra is sent;
- autopart's last stage computes the loss itself, so the schedule's ``loss_fn`` returns the
  stage's output, whose gradient it scales by 1/M as autopart's runtime scales each loss
  (`MicrobatchLoss`); torch's own scaling (``scale_grads``, which divides each stage's whole
  ``.grad`` at the end of the step, what earlier steps left there too) is off;
- each forward runs in the plan's precision and with its stage's recompute, as in ``train.py``;
- the buffers a forward updates (a step counter, BatchNorm's running statistics) end the step as
  ``train.py`` leaves them: each forward reads the step's starting values, what a recompute
  writes is put back, and ``reduce_gradients`` sets each to the mean over the step's forwards
  (`autopart.runtime.buffer_updates`); torch's own runs to infer shapes leave them as they were;
  call ``reduce_gradients`` after every step: ``step_inputs`` refuses the next step's batch until it ran;
- an evaluation (``schedule.eval``) runs as ``train.py``'s: without dropout, without autograd,
  and leaving the buffers as they were;
- each training forward draws (dropout) from ``train.py``'s seed for it (`autopart.runtime.draws`:
  ``build_stages(seed=)``, the step, the replica, the microbatch, the stage; `Draws`); a loop
  that continues a run from step N's weights (``build_stages(weights=, first_step=N)``) draws
  step N's, and ``batches()`` begin at step N's batch, as ``train.py --resume`` goes on.

Gradients accumulate over several ``schedule.step`` calls before one optimizer step as over
several ``loss.backward()`` calls: each adds the gradient of its batch's mean loss, and
``reduce_gradients`` after each sums over a tied weight's copies only what that step added. For
the mean over K steps, divide the gradients by K before the optimizer's step (or compile with K
times the microbatches, one step of the larger batch).

The plan's schedule maps to torch's class: gpipe -> ``ScheduleGPipe``, 1f1b -> ``Schedule1F1B``,
interleaved -> ``ScheduleInterleaved1F1B``, zb-h1 -> ``ScheduleInterleavedZeroBubble`` (with one
stage per rank it is ZB-H1, the order autopart's own ``zb-h1`` generator gives), zbv ->
``ScheduleZBVZeroBubble`` (the order of autopart's ``zbv``). Torch's class runs its own order:
hand edits of ``plan.schedule.actions`` reach ``train.py``, not this loop.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from autopart.ir.model_file import load_model_file
from autopart.ir.errors import ConfigError
from autopart.ir.plan import Plan, load_plan
from autopart.runtime import collectives
from autopart.runtime.buffer_updates import BufferUpdates
from autopart.runtime.data import global_batches, model_file, split_microbatches
from autopart.runtime.device import compute_device, on_device
from autopart.runtime.draws import draw_seed
from autopart.runtime.train_flags import SEED_LIMIT
from autopart.runtime.forward import StageForward, buffers_kept
from autopart.runtime.gradients import average_gradients, sum_tied_gradients, tied_groups
from autopart.runtime.launch import check_world_size
from autopart.runtime.mesh import Coordinates, Mesh, group_of
from autopart.runtime.stage import load_stage
from autopart.runtime.torchrun_command import plan_launch
from autopart.runtime.train_flags import check_initial_weights

__all__ = ["TORCH_SCHEDULES", "MicrobatchLoss", "ProcessGroups", "Pipeline", "build_stages", "loss_is_the_output"]

TORCH_SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,  # it places the two chunks of each rank in a V itself, as the plan does
}
_MULTI_STAGE = (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)  # they take a list of stages


def loss_is_the_output(output: torch.Tensor, target: Any) -> torch.Tensor:
    """The schedule's ``loss_fn``: autopart's last stage has computed the loss already."""
    return output


class _ScaledBackward(torch.autograd.Function):
    """The loss as it is, its gradient divided by the microbatches: the backward of ``loss / M``."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, microbatches: int) -> torch.Tensor:
        ctx.microbatches = microbatches
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.microbatches, None


@dataclass(frozen=True, kw_only=True)
class MicrobatchLoss:
    """The schedule's ``loss_fn``: the loss autopart's last stage computed, with the gradient of
    ``loss / microbatches``, as autopart's runtime scales it; the schedule's losses read as the
    stage's. Torch's ``scale_grads`` divides the whole ``.grad`` after each step instead, which
    divides again what earlier steps accumulated there."""

    microbatches: int

    def __call__(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        return _ScaledBackward.apply(output, self.microbatches)


class BatchByKeyword(nn.Module):
    """An autopart stage under torch's API: batch values arrive as ``batch_<name>`` keywords."""

    def __init__(self, forward: StageForward, module: nn.Module, batch_inputs: tuple[str, ...], updates: BufferUpdates):
        super().__init__()
        self.stage = module
        self.run = forward
        self.batch_inputs = batch_inputs
        self.updates = updates

        self.training_step = True  # False while torch infers its messages' shapes (`InferringStage`)

    def forward(self, *received: torch.Tensor, **batch: Any) -> Any:
        values = (*received, *(batch[f"batch_{name}"] for name in self.batch_inputs))
        if not self.training_step:  # an evaluation, or torch's inference: `not_a_step` keeps the buffers
            return self.run(*values)[0]
        if not torch.is_grad_enabled():  # a forward of one's own, outside torch's schedules
            with self.not_a_step():
                return self.run(*values)[0]
        with self.updates.forward():  # torch runs the backward, and its recompute: `StageForward.around_recompute`
            return _owning_storage(self.run(*values)[0])

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """An evaluation's forward (``schedule.eval``), as ``train.py``'s: it trains nothing, keeps
        no autograd graph (torch runs it with gradients on, and holds its outputs until the next
        step) and drops no units (the captured graph's dropouts are baked in training)."""
        dropout = self.run.dropout
        self.run.dropout = False
        try:
            with self.not_a_step(), torch.no_grad():
                yield
        finally:
            self.run.dropout = dropout

    @contextlib.contextmanager
    def not_a_step(self) -> Iterator[None]:
        """Forwards and backwards that train nothing: the buffers are left as they were, and none counts."""
        self.training_step = False
        try:
            with buffers_kept(self.updates.tracked_buffers()):
                yield
        finally:
            self.training_step = True


def _owning_storage(output: Any) -> Any:
    """``output`` with each tensor that is a view of another (``F.linear`` over 3-D activations
    reshapes its product) copied: torch's zero-bubble schedules detach a stage's outputs in place
    after the input-gradient pass, which a view refuses."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output._base is not None else output
    if isinstance(output, (tuple, list)):
        return type(output)(_owning_storage(item) for item in output)
    return output


@dataclass(kw_only=True)
class Draws:
    """Where the stages' random numbers come from, as ``train.py``'s (`autopart.runtime.draws`):
    its ``--seed``, this rank's replica, and the training step, counted by the forwards of the
    first microbatch on this rank's first stage (a loop need not call ``reduce_gradients`` where
    there is nothing to reduce, and an evaluation is no step)."""

    seed: int
    replica: int
    step: int = -1  # none begun

    def seed_forward(self, microbatch: int, stage: int) -> None:
        """Seed every device's generator for one training forward, as the executor does."""
        torch.manual_seed(draw_seed(draw_seed(self.seed, self.step, self.replica), microbatch, stage))


class InferringStage(PipelineStage):
    """torch's ``PipelineStage``, whose runs of the stage to infer its messages' shapes and dtypes
    (on the first step, and on a step with a backward after an evaluation) train nothing: torch
    runs the forward again on the first microbatch, and on a later stage on uninitialised tensors,
    then a backward through it, which a step counter or BatchNorm's running statistics would
    otherwise count (`BatchByKeyword.not_a_step`); nor do an evaluation's forwards
    (``schedule.eval``, `BatchByKeyword.evaluating`). Torch versions that infer shapes otherwise
    call neither inference method."""

    def __init__(self, *args: Any, draws: Draws, counts_steps: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.draws = draws
        self.counts_steps = counts_steps  # this rank's first stage, whose microbatch 0 begins each step

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.has_backward:  # a recompute replays the generator's state at this forward (torch's checkpoint)
            if self.counts_steps and fwd_chunk_id == 0:
                self.draws.step += 1
            self.draws.seed_forward(fwd_chunk_id, self.stage_index)
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        with self.submod.evaluating():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    # torch's runtime hands the input gradients of a V-shaped schedule's stage to the stage
    # before it on the same rank (ZBV), in an evaluation too, where there are none and torch's own
    # methods refuse: ``schedule.eval`` failed on its first backward action

    def get_local_bwd_output(self, mb_index: int) -> tuple[torch.Tensor | None, ...]:
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple[torch.Tensor | None, ...], mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with self.submod.not_a_step():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with self.submod.not_a_step():  # a recompute inside it runs the forward once more
            return super()._backward_metadata_inference(*args, **kwargs)


@dataclass(frozen=True, kw_only=True)
class ProcessGroups:
    """The mesh's groups of this rank (``autopart.runtime.mesh``: rank = (dp * pp + pp_index) * tp + tp_index)."""

    pp: dist.ProcessGroup  # the pipeline: PipelineStage's group
    tp: dist.ProcessGroup | None  # tensor parallelism, inside the stage modules' collectives; None at tp 1
    dp: dist.ProcessGroup | None  # data-parallel replicas; None at dp 1


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """This rank's share of a compiled plan."""

    plan: Plan
    out_dir: Path
    coordinates: Coordinates
    modules: dict[int, nn.Module]  # autopart's stage modules by stage index: their state dicts are the model's slices
    stages: list[PipelineStage]  # in stage order
    schedule_class: type
    groups: ProcessGroups
    tied: list[tuple[str, dist.ProcessGroup]]  # parameters several stages hold, and the group that sums them
    forwards: list[StageForward]  # how each stage's forward runs (its precision's working weights)
    updates: list[BufferUpdates]  # the buffers each stage's forwards update, through a step
    seed: int = 0  # train.py's --seed: the stages' draws, and by default the batches'
    first_step: int = 0  # the step the loop begins at: the draws' and the batches' first
    # the tied copies' gradients as the first step since the last reduce_gradients began (what was
    # summed already), by parameter; None until that step
    step_began: list[tuple[nn.Parameter, torch.Tensor]] | None = None

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage, whose schedule reports the losses."""
        return any(stage.is_last for stage in self.stages)

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules.values() for p in module.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Under their names in the original model (a tied parameter once per stage that holds it)."""
        return [item for module in self.modules.values() for item in module.named_parameters()]

    def schedule(self, **options: Any):
        """The plan's torch schedule over this rank's stages; ``options``: more of its keywords."""
        if "scale_grads" in options or "loss_fn" in options:
            raise ConfigError(f"pipeline.schedule() sets {'scale_grads' if 'scale_grads' in options else 'loss_fn'} "
                              "itself (the last stage computes the loss and scales its gradient by 1/M); leave it out")
        stages = self.stages if self.schedule_class in _MULTI_STAGE else self.stages[0]
        microbatches = self.plan.schedule.microbatches
        return self.schedule_class(stages, n_microbatches=microbatches, loss_fn=MicrobatchLoss(microbatches=microbatches),
                                   scale_grads=False, **options)  # fmt: skip

    def batches(self, seed: int | None = None) -> Iterator[tuple[tuple[Any, ...], Any]]:
        """The global batches that ``train.py --seed SEED`` draws, the same on every rank, from the
        loop's first step on (``build_stages(first_step=)``: a resumed train.py passes over those of
        the steps done too); by default of the seed the stages draw their dropout from
        (``build_stages(seed=)``), as train.py's one seed."""
        seed = self.seed if seed is None else _checked_seed(seed)
        spec = load_model_file(model_file(self.out_dir, self.plan), build=False)
        return itertools.islice(global_batches(spec, self.plan.schedule.global_batch_size, seed), self.first_step, None)

    def tied_copies(self) -> list[nn.Parameter]:
        """This rank's copies of the parameters that several stages hold."""
        tied = {name for name, _ in self.tied}
        return [p for module in self.modules.values() for name, p in module.named_parameters() if name in tied] \
            if tied else []

    def step_inputs(self, inputs: tuple[Any, ...], target: Any) -> dict[str, Any]:
        """The keywords of ``schedule.step`` for a global batch: this replica's share of the batch
        values its stages read, as ``batch_<name>``, and on the last stage ``target``. Call it once
        per step, after the optimizer's step: in ``bf16`` it casts the step's working copies of the
        weights (`autopart.runtime.forward`)."""
        if any(updates.forwards for updates in self.updates):  # a step's forwards ran, and it was never settled
            raise ConfigError("the last step's buffer updates were not settled: call pipeline.reduce_gradients() after "
                              "each schedule.step, before the optimizer's step (it also sets the buffers the "
                              "forwards update, as train.py does)")
        for forward in self.forwards:
            forward.begin_step()
        if self.step_began is None:  # steps since then add to the gradients; reduce_gradients sums what they added
            object.__setattr__(self, "step_began", [(p, p.grad.clone()) for p in self.tied_copies() if p.grad is not None])
        values = (*inputs, target) if len(self.plan.graph_inputs) > len(inputs) else tuple(inputs)
        share = split_microbatches(values, self.plan.mesh["dp"])[self.coordinates.dp]
        by_name = dict(zip(self.plan.graph_inputs, share, strict=True))
        read = {name for s in self.modules for name in self.plan.stages[s].batch_inputs}
        keywords = {f"batch_{name}": by_name[name] for name in self.plan.graph_inputs if name in read}
        if self.is_last:  # torch splits it for loss_fn, which returns the loss the stage computed
            keywords["target"] = next(v for v in share if isinstance(v, torch.Tensor))
        # on the stages' device: torch's stages hand keywords to the module as they are given
        return {key: on_device(v, self.stages[0].device) for key, v in keywords.items()}

    def reduce_gradients(self) -> None:
        """After ``schedule.step``: every copy of a tied parameter gets the sum of their gradients,
        then data-parallel replicas average theirs (``train.py``'s order), and each buffer that the
        forwards update takes the mean of what the step's forwards, on every replica, left it at.
        Gradients accumulated over several steps stay their sum, whether it is called after each
        of them or once after the last (as DDP's no_sync accumulates): a tied copy's sum is of what
        the steps since the last call added (earlier ones are summed already), and the replicas'
        mean of what they hold alike is itself. Steps whose gradients are dropped (zeroed) are
        first reduced as the others, or the next call subtracts what they held."""
        began = self.step_began or []
        for parameter, before in began:
            parameter.grad.sub_(before)
        for name, group in self.tied:
            sum_tied_gradients(self.modules, name, group)
        for parameter, before in began:
            parameter.grad.add_(before)
        object.__setattr__(self, "step_began", None)
        if self.groups.dp is not None:
            average_gradients(self.parameters(), self.groups.dp, self.plan.mesh["dp"])
        for updates in self.updates:
            updates.finish()


def build_stages(out_dir: str | Path, *, device: torch.device | None = None, weights: str | Path | None = None,
                 timeout: datetime.timedelta | None = None, seed: int = 0, first_step: int = 0) -> Pipeline:
    """This rank's stages of the compile in ``out_dir`` as ``PipelineStage`` objects.

    Call it on every rank after ``dist.init_process_group``, with the plan's world size: it makes
    the mesh's process groups, which every rank must create together, with ``timeout`` (None:
    torch's default for a new group, whatever the world group's). ``weights``: a safetensors
    file of the whole model to start from (``train.py --weights``), else the compile's weights.
    ``seed``: ``train.py``'s ``--seed``, whose draws (dropout) the step's forwards make.
    ``first_step``: the step a loop that continues a run begins at (the steps its ``weights``
    trained, as ``train.py --resume`` from that step's checkpoint): its first ``schedule.step``
    draws that step's dropout, and ``batches()`` begin at that step's batch.
    """
    _checked_seed(seed)  # train.py refuses it before anything starts
    if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
        raise ConfigError(f"first_step is the number of steps already trained, an integer 0 or more, "
                          f"got {first_step!r}")
    out_dir = Path(out_dir).resolve()
    weights = None if weights is None else Path(weights)  # a path given as a string, as out_dir may be
    plan = load_plan(out_dir / "plan.json")
    selective = [s.index for s in plan.stages if s.recompute == "selective"]
    if plan.schedule.kind in ("zb-h1", "zbv") and selective:
        raise ConfigError(
            f"stage {selective[0]} recomputes selectively, which torch's {TORCH_SCHEDULES[plan.schedule.kind].__name__} "
            "cannot run: it takes each backward in two passes (inputs, then weights), and a selective checkpoint "
            "allows one; compile with --recompute full or none, or another --schedule, or train with train.py"
        )
    if not dist.is_initialized():
        raise ConfigError("build_stages needs a process group: call torch.distributed.init_process_group first "
                          "(run the script under torchrun)")  # fmt: skip
    check_world_size(plan, dist.get_world_size(), plan_launch(plan, shlex.quote(sys.argv[0] or "SCRIPT.py")).one_line())
    device = device or compute_device()
    mesh = Mesh.of(plan)
    rank = dist.get_rank()
    check_initial_weights(weights, out_dir, plan, rank)  # one line, as train.py's, before any group is made
    here = mesh.coordinates(rank)
    device_mesh = mesh.device_mesh(device.type, timeout)
    groups = ProcessGroups(
        pp=device_mesh.get_group("pp"), tp=group_of(device_mesh, "tp"), dp=group_of(device_mesh, "dp")
    )
    collectives.set_group(groups.tp)
    modules: dict[int, nn.Module] = {}
    stages: list[PipelineStage] = []
    forwards: list[StageForward] = []
    updates: list[BufferUpdates] = []
    replicas = (groups.dp, mesh.dp) if groups.dp is not None else None
    draws = Draws(seed=seed, replica=here.dp, step=first_step - 1)  # the step before the first: none of its own begun
    for stage_plan in plan.stages:
        if stage_plan.rank != here.pp:
            continue
        module = load_stage(out_dir, stage_plan.index, device, tp_rank=here.tp, tp=mesh.tp, weights=weights,
                            placements=stage_plan.parameter_placements)  # fmt: skip
        updates.append(BufferUpdates(module, replicas, getattr(module, "updated_buffers", None)))
        # torch splits a zero-bubble backward itself, with autograd: the stage's forward is a plain
        # one, which recomputes in I and again in W, wherever torch's order puts them
        forward = StageForward(module, recompute=stage_plan.recompute, dtype=plan.dtype, device=device,
                               split_backward=False, around_recompute=updates[-1].recompute())  # fmt: skip
        modules[stage_plan.index] = module
        forwards.append(forward)
        wrapped = BatchByKeyword(forward, module, stage_plan.batch_inputs, updates[-1])
        stages.append(InferringStage(wrapped, stage_plan.index, len(plan.stages), device, group=groups.pp, draws=draws,
                                     counts_steps=not stages))  # fmt: skip
    return Pipeline(plan=plan, out_dir=out_dir, coordinates=here, modules=modules, stages=stages,
                    schedule_class=TORCH_SCHEDULES[plan.schedule.kind], groups=groups,
                    tied=tied_groups(plan, mesh, rank), forwards=forwards, updates=updates, seed=seed,
                    first_step=first_step)  # fmt: skip


def _checked_seed(seed: int) -> int:
    """``seed``, where train.py's --seed takes it (its draws are 64-bit)."""
    if not -SEED_LIMIT < seed < SEED_LIMIT:
        raise ConfigError(f"the seed must lie between -2**40 and 2**40, got {seed}; give a smaller seed")
    return seed
