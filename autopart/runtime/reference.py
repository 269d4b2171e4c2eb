"""The single-process reference: the original model trained eagerly on the same batches.

The generated programs must match it: the same per-step losses and the same final parameters,
to float tolerance. Tests and ``autopart verify`` compare against it. A bf16 plan's reference runs
each forward under ``torch.autocast(bfloat16)`` too, over the weights its precision uses, as the
stages do (``bf16``: working copies cast once per step, gradients accumulated into the fp32
weights; ``bf16-autocast``: the fp32 weights); recompute changes nothing that it computes, so the
reference has none. A model that draws random numbers (dropout) draws here what a plan of one
stage, one microbatch and one rank draws (``draw_seed``); other plans draw per microbatch, stage
and tensor-parallel slice, which no single forward over the whole batch repeats. It applies
train.py's `Recipe` with torch's own means (``LambdaLR``, ``clip_grad_norm_`` over the model's
parameters, each once), which the distributed programs must equal. Buffers that a forward
updates (a counter, BatchNorm's statistics) move once per step, as one forward of the whole batch
moves them; where it sums its gradient over parts of the batch (``microbatches``) each part
starts from the step's buffers and they end at the parts' mean, as the programs' microbatches do
(`autopart.runtime.buffer_updates`).

A model whose ops normalise by their batch's statistics (``plan.batch_statistics``: BatchNorm in
training) computes another function on a part of the batch than on the whole: the programs train
it over each replica's microbatches, as DDP and pipelining do. For such a plan the reference runs
one forward per microbatch of each replica, on the same samples, each loss scaled as the plan
scales it, and evaluates so too; for any other it runs one forward over the whole batch, which
checks more (that the plan's parts add up to it).

Which buffers move is what the stage files say (``updated_buffers``), the very list under test: a
buffer that list leaves out moves once per forward in the reference as in the programs, and where
the reference runs one forward per microbatch too (a plan with batch statistics) the two agree.
So the reference can also find by value, around each of its forwards, the buffers that move and
that no stage file lists (``watch_buffers``): it is one process, where a copy of every buffer per
forward costs no rank's memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from autopart.ir.errors import ConfigError
from autopart.ir.tensors import precision, working_dtype
from autopart.ir.model_file import ModelSpec, eager_loss, load_model_file
from autopart.ir.plan import Plan, load_plan
from autopart.runtime.data import eval_batches, model_file, split_microbatches, training_batches
from autopart.runtime.materialise import materialise, meta_names
from autopart.runtime.stage import stage_names
from autopart.runtime.buffer_updates import BufferUpdates, stages_updated_buffers
from autopart.runtime.draws import draw_seed
from autopart.runtime.forward import NoDropout, buffers_kept, working_copies
from autopart.runtime.optim import make_optimizer
from autopart.runtime.recipe import Recipe, parameter_groups
from autopart.runtime.shards import load_stage_weights

__all__ = ["ReferenceRun", "initial_weights", "plan_parts", "train_reference"]


@dataclass(frozen=True, kw_only=True)
class ReferenceRun:
    losses: list[float]
    parameters: dict[str, torch.Tensor]  # by the names the stages use
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> mean held-out loss after it
    # buffers that a forward moved and that no stage file lists as updated (found with ``watch_buffers``)
    unlisted_moves: tuple[str, ...] = ()


def _parts(batch: tuple[tuple[Any, ...], Any], replicas: int, microbatches: int) -> list[tuple[tuple[Any, ...], Any]]:
    """A batch (inputs, target) as each of ``replicas`` shares of it in ``microbatches`` parts, in
    that order, as train.py splits it (`split_microbatches`)."""
    if replicas * microbatches == 1:
        return [batch]
    inputs, target = batch
    shares = split_microbatches((*inputs, target), replicas)
    return [(tuple(part[:-1]), part[-1]) for share in shares for part in split_microbatches(share, microbatches)]


def _shuffled(parts: list[tuple[tuple[Any, ...], Any]], seed: int | None) -> list[tuple[tuple[Any, ...], Any]]:
    """Each part's samples in an order drawn from ``seed`` (None: as they are). A model that
    treats its samples alike (a mean loss, a batch norm's statistics) computes the same function
    over them, with its sums over the batch taken in another order."""
    if seed is None:
        return parts
    generator = torch.Generator().manual_seed(seed)
    shuffled = []
    for inputs, target in parts:
        size = next((v.shape[0] for v in (*inputs, target) if isinstance(v, torch.Tensor)), 0)
        order = torch.randperm(size, generator=generator)
        inputs = tuple(v[order] if isinstance(v, torch.Tensor) else v for v in inputs)
        shuffled.append((inputs, target[order] if isinstance(target, torch.Tensor) else target))
    return shuffled


def plan_parts(plan: Plan) -> tuple[int, int]:
    """(replicas, microbatches): the parts of the batch that the reference of ``plan`` runs one
    forward each on, the plan's own where its ops normalise by their batch (module docstring)."""
    if not plan.batch_statistics:
        return 1, 1
    return plan.mesh["dp"], plan.schedule.microbatches


def initial_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    """The union of every stage's initial weights, whole, by their names in the original model."""
    weights: dict[str, torch.Tensor] = {}
    for stage in load_stage_weights(load_plan(out_dir / "plan.json"), out_dir / "weights").values():
        weights.update(stage)
    return weights


def _started(spec: ModelSpec, initial: dict[str, torch.Tensor], *, out_dir: Path, device: str,
             dtype: torch.dtype | None) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model on ``device`` (and in ``dtype``, where given), and its parameters and buffers by
    name, set to ``initial`` (the compile's weights)."""
    model, file = spec.module, spec.path.name
    assert model is not None
    if any(True for _ in meta_names(model)):  # made as every rank makes its slice
        materialise(model, meta_names(model), init=spec.init_weights)
    model.to(device=device)  # before naming them: a buffer moved or cast is another tensor
    if dtype is not None:  # real floating tensors only: a complex buffer (RoPE's) cast to a real dtype loses a part
        model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, value in initial.items():
            if name in named:  # not the constants that the model makes in forward
                if named[name].shape != value.shape:
                    raise ConfigError(f"{file} now builds '{name}' of shape {tuple(named[name].shape)}, where "
                                      f"{out_dir} was compiled with {tuple(value.shape)} (a file it imports changed?); "
                                      "compile it again")
                named[name].copy_(value)
    return model, named


def _on(value: Any, device: str, dtype: str) -> Any:
    """A batch value on ``device``; a floating one in float64 for an ``fp64`` reference."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device, torch.float64 if dtype == "fp64" and value.is_floating_point() else None)


@contextlib.contextmanager
def _float64() -> Iterator[None]:
    """Tensors that a forward makes without a dtype (a mask, a scale) in float64, as its weights."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(default)


@contextlib.contextmanager
def _unlisted_moves(model: torch.nn.Module, listed: tuple[str, ...] | None, moved: set[str]) -> Iterator[None]:
    """Adds to ``moved`` the names of the buffers outside ``listed`` (None: every buffer is listed)
    whose values the body changes: a NaN left a NaN is unchanged."""
    if listed is None:
        yield
        return
    before = {name: buffer.detach().clone() for name, buffer in model.named_buffers() if name not in listed}
    yield
    after = dict(model.named_buffers())
    moved.update(name for name, value in before.items() if name not in after or not _same(after[name], value))


def _same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    equal = got.detach() == expected
    if got.is_floating_point() or got.is_complex():
        equal |= got.detach().isnan() & expected.isnan()
    return bool(equal.all())


def train_reference(
    out_dir: str | Path, *, steps: int, lr: float, optimizer: str, seed: int = 0, weights: Path | None = None,
    dtype: str | None = None, device: str = "cpu", recipe: Recipe | None = None, eval_every: int = 0,
    eval_batch_count: int = 1, dropout: bool = True, microbatches: int | None = None, sample_order: int | None = None,
    watch_buffers: bool = False,
) -> ReferenceRun:
    """``weights`` is the checkpoint the programs were started from (``train.py --weights``), if any;
    ``dtype`` the precision, by default the plan's (``"fp64"``: the model and its batches in
    float64, the nearest to exact sums one process has: how far fp32's roundings alone take
    training is how far an fp32 run ends from it, `autopart.tools.verify`'s measure); ``device``
    where it trains (``"cuda"``: the current GPU, to compare with programs that ran on GPUs:
    autocast and kernels differ by device);
    ``recipe`` the schedule, decay and clipping of train.py's flags; ``eval_every`` and
    ``eval_batch_count``: train.py's ``--eval-every`` and ``--eval-batches``; ``dropout`` False:
    train.py's ``--no-dropout``; ``microbatches``: the batch's gradient summed over this many
    parts of it (another order of the same sums, as a pipeline adds them), by default the plan's
    parts where they train another function than the whole batch (`plan_parts`), else one;
    ``sample_order``: a seed by which to shuffle the samples of each part (`_shuffled`);
    ``watch_buffers``: find the buffers that move and that no stage file lists (module docstring)."""
    recipe = recipe or Recipe()
    out_dir = Path(out_dir)
    plan = load_plan(out_dir / "plan.json")
    spec = load_model_file(model_file(out_dir, plan))
    dtype = dtype or plan.dtype
    model, named = _started(spec, load_file(str(weights)) if weights is not None else initial_weights(out_dir),
                            out_dir=out_dir, device=device, dtype=torch.float64 if dtype == "fp64" else None)
    held = [name for stage in plan.stages for name in stage_names(out_dir, stage.index)]
    groups = parameter_groups(model.named_parameters(), weight_decay=recipe.weight_decay,
                              embeddings=plan.embedding_parameters)
    opt = make_optimizer(optimizer, groups, lr, **recipe.optimizer_options())
    scheduler = recipe.scheduler(opt, lr, steps)
    batch_size = plan.schedule.global_batch_size
    data = training_batches(spec, batch_size, seed)
    held_out = eval_batches(spec, batch_size, seed, eval_batch_count) if eval_every else []

    lower = None if dtype == "fp64" else working_dtype(dtype)
    replicas, microbatches = plan_parts(plan) if microbatches is None else (1, microbatches)

    def loss_of(inputs: tuple, target: Any) -> torch.Tensor:
        inputs = tuple(_on(x, device, dtype) for x in inputs)
        target = _on(target, device, dtype)
        # bf16: the step's working copies, cast after the last optimizer step, as the stages cast theirs
        weights = working_copies(model, lower) if lower is not None else None
        with _float64() if dtype == "fp64" else precision(dtype, torch.device(device).type):
            return eager_loss(spec, inputs, target, weights)

    losses, evaluations = [], {}
    listed = stages_updated_buffers(out_dir)
    updates = BufferUpdates(model, updated=listed)
    moved: set[str] = set()
    watched = listed if watch_buffers else None
    for step in range(steps):
        # seeded as the programs seed replica 0's first microbatch on stage 0: a model that draws
        # (dropout) draws the same here as a plan of one stage, one microbatch and one rank does
        batch = next(data)  # before seeding, as train.py draws it
        torch.manual_seed(draw_seed(draw_seed(seed, step, 0), 0, 0))
        with contextlib.nullcontext() if dropout else NoDropout():
            loss = torch.zeros(())
            for inputs, target in _shuffled(_parts(batch, replicas, microbatches), sample_order):
                with updates.forward(), _unlisted_moves(model, watched, moved):
                    part = loss_of(inputs, target) / (replicas * microbatches)
                part.backward()
                loss = loss + part.detach().cpu()
            updates.finish()  # parts leave the buffers as the whole batch does, as the programs' microbatches
        if recipe.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
        if eval_every and (step + 1) % eval_every == 0:
            with (torch.no_grad(), NoDropout(), buffers_kept(updates.tracked_buffers()),  # as the programs evaluate
                  _unlisted_moves(model, watched, moved)):
                parts = [part for batch in held_out for part in _parts(batch, replicas, microbatches)]
                evaluations[step] = sum(loss_of(*part).item() for part in parts) / len(parts)
    final = {name: named[name].detach().cpu().clone() for name in held}
    return ReferenceRun(losses=losses, parameters=final, eval_losses=evaluations, unlisted_moves=tuple(sorted(moved)))
