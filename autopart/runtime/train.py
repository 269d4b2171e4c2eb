"""The training loop that every generated ``train.py`` runs, one process per rank under torchrun
(a 1-rank plan also as ``python OUT/train.py``, `autopart.runtime.launch.init_process_group`).

    torchrun --nproc-per-node P OUT/train.py [--steps N] [--lr LR] [--optimizer sgd|adamw]
        [--seed S] [--metrics FILE] [--trace FILE] [--action-times DIR] [--save-weights DIR] [--timeout S]
        [--seconds S [--min-steps N] [--untimed-steps N]]
        [--weights CKPT.safetensors]
        [--checkpoint-dir DIR] [--checkpoint-every K] [--resume] [--no-dropout]
        [--lr-schedule constant|cosine|linear] [--warmup-steps N] [--min-lr X] [--clip-grad-norm X]
        [--weight-decay X] [--momentum X [--nesterov]] [--betas B1,B2]
        [--eval-every K] [--eval-batches N] [--tensorboard DIR]

Each rank builds its stage from ``stages/stage_<k>.py`` and ``weights/stage_<k>.safetensors``
(or, with ``--weights CKPT``, the stage's tensors of a whole-model safetensors checkpoint; or,
for a model built on the meta device, the model's initialisers run for the stage's tensors),
draws the same global batches as every other rank, runs its action list of the plan's schedule
(each forward in the plan's precision and with its stage's recompute, `autopart.runtime.forward`;
the data-parallel all-reduce of each bucket of gradients launched as soon as they are final,
`autopart.runtime.reducer`), waits for that all-reduce, sums the gradients of parameters that
several stages hold (tied embeddings), and steps its optimizer, with the `autopart.runtime.recipe`
of the flags (learning-rate schedule, weight decay by parameter, SGD's momentum, clipping of the
whole model's gradient norm, `autopart.runtime.gradients`).
Every ``--eval-every`` K steps it runs the pipeline's forwards alone on ``--eval-batches`` held-out
batches (`autopart.runtime.data.eval_batches`). Rank 0 reports each step's loss, tokens/s,
TFLOP/s per device and MFU (`autopart.runtime.progress`). NCCL when CUDA is present, gloo
otherwise (`autopart.runtime.device`).
``--trace FILE`` writes the measured timeline of the last step as a Chrome trace, in the form of
compile's predicted ``trace.json``; ``--action-times DIR`` has each rank write ``DIR/rank_<r>.jsonl``, a line per step with the wall
and CPU seconds of every action and of the step's tail (tied gradients, optimizer), which
``autopart compile --profile-pipeline`` reads; it runs for ``--seconds`` (past ``--untimed-steps``,
at least ``--min-steps``, at most ``--steps``), stopping every rank after the same step
(`autopart.runtime.measure.StopRule`).
With ``--checkpoint-dir`` it saves every K
steps and at the end; ``--resume``, or a restart by ``torchrun --max-restarts``, continues from the
latest good checkpoint there.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopart.ir.model_file import load_model_file
from autopart.ir.errors import AutopartError, ConfigError
from autopart.ir.plan import Plan, load_plan, takes_gradient
from autopart.ir.tensors import working_dtype
from autopart.runtime.data import eval_batches, model_file, split_microbatches, training_batches
from autopart.runtime.checkpoint import CheckpointContext, restarted
from autopart.runtime.checkpoint_folders import check_folder
from autopart.runtime.device import (Mark, StepTimer, backend, barrier, compute_device, peak_memory_per_rank,
                                     reset_peak_memory)
from autopart.runtime.device import tensor as device_tensor
from autopart.runtime.executor import Executor, StageRuntime, StepFailure
from autopart.runtime.draws import draw_seed
from autopart.runtime.forward import StageForward
from autopart.runtime.fully_sharded import FSDP_LEVELS, check_level, end_of_step, full_state, shard_stage
from autopart.runtime.launch import (PLAN_HASH_KEY, RefusedTogether, check_launch, check_nodes_agree, drawn_alike,
                                     init_process_group, inject_failure, leave_with_node, older_torch, plan_digest)
from autopart.runtime.measure import StepClock, StopRule, write_action_times, write_measured_trace
from autopart.runtime.gradients import clip_gradients, sum_tied_gradients, tied_groups
from autopart.runtime.reducer import GradientReducer
from autopart.runtime.optim import make_optimizer
from autopart.runtime.process_exit import leave, say
from autopart.runtime.sharded_masters import ShardedMasters
from autopart.runtime.output_paths import save_tensors
from autopart.runtime.train_flags import (check_arguments, check_compile_kept, check_initial_weights,
                                          check_weights_folder, note_optimizer_state, resumed, resumed_past_the_end,
                                          parse_args, timeout_to_refuse_with)
from autopart.runtime.progress import StepReporter, Throughput, check_tensorboard, tokens_in
from autopart.runtime.recipe import Recipe, parameter_groups
from autopart.runtime import collectives
from autopart.runtime.mesh import Coordinates, Mesh, group_of
from autopart.runtime.p2p import Channels, Scatter
from autopart.runtime.shards import weights_file_name
from autopart.runtime.stage import load_stage
from autopart.schedule import Kind, Schedule, plan_actions

__all__ = ["main", "leave"]


def main(out_dir: str | Path, argv: list[str] | None = None) -> None:
    out_dir = Path(out_dir).resolve()
    try:  # a rank killed by a signal (an abort in a collective library) prints where it was
        faulthandler.enable()
    except ValueError:  # stderr is no file here (a caller captured it): there is nowhere to print
        pass
    try:
        _train(out_dir, argv)
    except AutopartError as exc:
        _refuse(exc)
        raise SystemExit(2) from None


def _refuse(exc: AutopartError) -> None:
    """This rank's line; of a refusal that every rank makes, once every one has said its own."""
    say(f"autopart: error: {exc}")
    if isinstance(exc, RefusedTogether):
        exc.leave_together()


def _train(out_dir: Path, argv: list[str] | None) -> None:
    plan = load_plan(out_dir / "plan.json")
    digest = plan_digest(out_dir / "plan.json")  # of the plan this run trains: the weights it saves name it
    try:
        args = parse_args(argv, plan)
    except SystemExit as refused:  # argparse's line printed (or --help's text): the same on every rank of this node
        if refused.code:
            leave_with_node()
        raise
    rank = int(os.environ.get("RANK", "0"))
    try:
        schedule, source_file, device = _checked(out_dir, plan, args, rank, digest)
    except AutopartError as refusal:  # told to every rank first: a peer on another node would wait for this one
        init_process_group("gloo", timeout_to_refuse_with(args.timeout), refusal=str(refusal))  # raises it under torchrun
        raise
    store = init_process_group(backend(device), args.timeout)
    try:
        check_nodes_agree(out_dir, args, store)
        _loop(out_dir, plan, schedule, args, rank, device, source_file, store, digest)
        # every rank leaves together: a gloo rank whose peer closed its sockets first can abort
        # (SIGABRT) in its own teardown. Not on an error, where a peer may never come.
        barrier(device)
    except StepFailure as failure:
        _leave_failed(rank, failure)
    except AutopartError as refusal:  # refused once the group was made: left as a finished run leaves, and for
        dist.destroy_process_group()  # its reason (gloo's teardown of a group can abort, `leave`)
        _refuse(refusal)
        leave(2)
    finally:  # done: no collective is left in flight
        dist.destroy_process_group()


def _leave_failed(rank: int, failure: StepFailure) -> NoReturn:
    """Say where this rank failed and end it at once, without the process group's teardown: NCCL's
    waits for every kernel still queued, a receive from a dead peer among them, so the line would
    come only after the peers' watchdogs had aborted them (``--timeout``), if at all."""
    say(f"autopart: error on rank {rank}: {failure}")
    os._exit(1)


def _checked(out_dir: Path, plan: Plan, args: argparse.Namespace, rank: int, digest: str
             ) -> tuple[Schedule, Path, torch.device]:
    """What this rank refuses before it waits for a peer; its schedule, model file and device."""
    check_launch(out_dir, plan, rank=rank, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    older = older_torch(plan)
    if older is not None and rank == 0:
        say(f"autopart: warning: {older}")
    if args.resume and args.checkpoint_dir is None:
        raise ConfigError("--resume needs --checkpoint-dir DIR: the folder the checkpoints were saved in")
    if args.checkpoint_dir is not None:
        check_folder(args.checkpoint_dir, resuming=args.resume or restarted())
    check_tensorboard(args.tensorboard)
    check_compile_kept(out_dir, plan, args)  # first: it names the compile's file, where others see a stranger's
    check_arguments(args)
    check_weights_folder(args.save_weights, plan, digest)
    source_file = model_file(out_dir, plan)
    schedule = plan_actions(plan, compiled=True)  # a bad hand edit stops every rank here, before any waits for a peer
    if not plan.schedule.actions and rank == 0:
        print(f"autopart: note: plan.json stores no schedule.actions (written by an earlier autopart); running "
              f"the {plan.schedule.kind} order generated from its kind, as it ran then", file=sys.stderr)
    check_initial_weights(args.weights, out_dir, plan, rank)
    note_optimizer_state(args, plan, rank)
    return schedule, source_file, compute_device()


def _loop(out_dir: Path, plan: Plan, schedule: Schedule, args: argparse.Namespace, rank: int, device: torch.device,
          source_file: Path, store: dist.Store | None, digest: str) -> None:
    mesh = Mesh.of(plan)
    here = mesh.coordinates(rank)
    device_mesh = mesh.device_mesh(device.type, datetime.timedelta(seconds=args.timeout))
    collectives.set_group(group_of(device_mesh, "tp"))
    data_parallel = group_of(device_mesh, "dp")
    schedule_spec = plan.schedule
    stages, executor = _executor(out_dir, plan, schedule, args, rank, device, device_mesh, data_parallel)
    fully_sharded = _fully_shard(stages, plan, executor, device_mesh)
    tied = tied_groups(plan, mesh, rank, datetime.timedelta(seconds=args.timeout))
    modules = {s: stage.module for s, stage in stages.items()}
    recipe = Recipe.from_args(args)
    optimizer = _optimizer(modules, plan, args, recipe, data_parallel)
    spec = load_model_file(source_file, build=False)
    data = drawn_alike(training_batches(spec, schedule_spec.global_batch_size, args.seed, epochs=args.seconds is not None),
                       store, rank)
    holds_loss = len(plan.stages) - 1 in stages and here.tp == 0
    checkpointing = CheckpointContext(
        root=args.checkpoint_dir, out_dir=out_dir, modules=modules,
        optimizer=optimizer, optimizer_name=args.optimizer, rank=rank, dp_rank=here.dp, tp_rank=here.tp,
        zero=plan.zero, seed=args.seed, device=device, flags=recipe.flags(args.lr, args.steps),
    )  # fmt: skip
    first_step = resumed(checkpointing, args, rank)
    if resumed_past_the_end(args, first_step, restarted=restarted()):
        return
    for _ in range(first_step):
        next(data)  # the data position: the batches of the steps already done
    scheduler = recipe.scheduler(optimizer, args.lr, args.steps, done=first_step)
    held_out = eval_batches(spec, schedule_spec.global_batch_size, args.seed, args.eval_batches) if args.eval_every else []
    reporter = StepReporter(steps=args.steps, seconds=args.seconds, first_step=first_step, metrics=args.metrics,
                            tensorboard=args.tensorboard, resumed=args.resume or restarted()) \
        if holds_loss and here.dp == 0 else None
    split = functools.partial(_shares, dp=mesh.dp, dp_rank=here.dp, microbatches=schedule_spec.microbatches)
    stop = StopRule(first_step, args.steps, args.seconds, min_steps=args.min_steps or 1,
                    untimed=args.untimed_steps or 0)
    reset_peak_memory(device)
    settled = False  # whether the device ran nothing since the previous step's end but its reductions
    for step in range(first_step, args.steps):
        inject_failure(rank, step)
        inputs, target = next(data)
        values = _graph_values(plan, inputs, target)
        clock, record = _recording(args, step, device)
        timer = StepTimer(device, settle=record is not None or not settled)
        losses = executor.step(split(values), record=record, timer=timer, seed=draw_seed(args.seed, step, here.dp))
        tail_start, tail_cpu = timer.mark(), time.thread_time()
        launched = _reduce(executor.reducer)  # the mean over the replicas first: a tied copy's sum is of means
        reduced = timer.mark()
        _sum_tied(modules, tied, fully_sharded)
        tied_end = timer.mark()
        norm = clip_gradients(modules, plan, here, recipe.clip_grad_norm) if recipe.clip_grad_norm else None
        optimizer_start = timer.mark()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        end, tail_cpu = timer.stop(), time.thread_time() - tail_cpu
        if args.action_times:  # after the step's clock stopped
            marks = (timer.seconds(tail_start), end, tail_cpu, timer.seconds(tied_end), timer.seconds(optimizer_start))
            write_action_times(args.action_times, rank, step, timer.start, record, marks,
                                (timer.seconds(reduced), [timer.seconds(mark) for mark in launched]))
        elapsed = device_tensor([end - timer.start], device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        stopping = stop.after(elapsed)
        peaks = peak_memory_per_rank(device, reporter is not None) if args.metrics else {"peak_memory_bytes": []}
        evaluated = args.eval_every and (step + 1) % args.eval_every == 0
        eval_losses = _evaluate(executor, held_out, split, plan, modules, fully_sharded) if evaluated else []
        if holds_loss:  # every replica all-reduces its losses; the reporter alone reads them
            loss = _mean_loss(losses, data_parallel, mesh.dp)
            eval_loss = _mean_loss(eval_losses, data_parallel, mesh.dp) if evaluated else None
            if reporter is not None:
                _report(reporter, plan, inputs, {"step": step, **peaks, "lr": lr}, loss, elapsed, norm, eval_loss)
        if clock is not None:
            _write_trace(clock, plan, args, step)
        if saving := _checkpoint_due(args, step, stopping):
            _save(checkpointing, step + 1, rank)
        if stopping:
            break
        settled = not (evaluated or saving)
    _finish(args, reporter, optimizer, stages, here, mesh.tp, digest)


def _finish(args: argparse.Namespace, reporter: StepReporter | None, optimizer: Any, stages: dict[int, StageRuntime],
            here: Coordinates, tp: int, digest: str) -> None:
    """After the last step: the progress bar closed, the final weights written where asked for."""
    if reporter is not None:
        reporter.close()
    if args.save_weights:
        if isinstance(optimizer, ShardedMasters):  # the final weights are the fp32 masters, whole
            optimizer.gather_masters()
        _save_weights(args.save_weights, stages, here, tp, digest)


def _reduce(reducer: GradientReducer | None) -> list[Mark]:
    """Wait for the step's data-parallel all-reduce, if there are replicas; when each bucket was
    launched (the step timer's marks)."""
    if reducer is None:
        return []
    launched = list(reducer.launched_at)
    reducer.wait()
    return launched


def _optimizer(modules: dict[int, torch.nn.Module], plan: Plan, args: argparse.Namespace, recipe: Recipe,
               data_parallel: Any) -> torch.optim.Optimizer:
    """The optimizer over this rank's parameters, in the recipe's groups, sharded over dp with ZeRO-1."""
    named = [item for module in modules.values() for item in module.named_parameters()]
    groups = parameter_groups(named, weight_decay=recipe.weight_decay, embeddings=plan.embedding_parameters)
    zero_group = data_parallel if plan.zero == 1 else None
    return make_optimizer(args.optimizer, groups, args.lr, zero_group=zero_group,
                          shard_masters=working_dtype(plan.dtype) is not None, fully_sharded=plan.zero in FSDP_LEVELS,
                          **recipe.optimizer_options())


def _recording(args: argparse.Namespace, step: int, device: torch.device
               ) -> tuple[StepClock | None, list | None]:
    """The clock of the step that ``--trace`` draws (the last), and where the step's actions are
    recorded, if they are (``--trace``, ``--action-times``)."""
    clock = StepClock(device) if args.trace and step == args.steps - 1 else None
    return clock, clock.record if clock else [] if args.action_times else None


def _checkpoint_due(args: argparse.Namespace, step: int, stopping: bool) -> bool:
    """Whether a checkpoint is saved after ``step``: every ``--checkpoint-every`` steps, and after the last."""
    every = args.checkpoint_every
    return bool(args.checkpoint_dir) and (stopping or bool(every and (step + 1) % every == 0))


def _report(reporter: StepReporter, plan: Plan, inputs: tuple, line: dict, loss: torch.Tensor, step_s: torch.Tensor,
            norm: torch.Tensor | None, eval_loss: torch.Tensor | None) -> None:
    """One step's line, with its values read here, on the reporter alone, after the step's sync:
    the loss, the step's seconds, and the gradient norm and held-out loss where there are ones."""
    line = {"step": line.pop("step"), "loss": loss.item(), "step_s": step_s.item(), **line}  # in the metrics' order
    line |= {"grad_norm": norm.item()} if norm is not None else {}
    line |= {"eval_loss": eval_loss.item()} if eval_loss is not None else {}
    reporter.step(line, Throughput.of(plan, tokens=tokens_in(inputs), step_s=line["step_s"]))


def _sum_tied(modules: dict[int, torch.nn.Module], tied: list, fully_sharded: bool) -> None:
    """Every copy of a tied parameter gets the sum of their gradients; under ZeRO-2/3 once FSDP's
    last reduce-scatters have landed in the gradients' shards, as the whole parameters go."""
    if fully_sharded:
        end_of_step(list(modules.values()))
    for name, group in tied:
        sum_tied_gradients(modules, name, group)


def _evaluate(executor: Executor, held_out: Iterable, split: Any, plan: Plan, modules: dict[int, torch.nn.Module],
              fully_sharded: bool) -> list[torch.Tensor]:
    """The held-out batches' losses held here, outside the step's clock; under ZeRO-2 the
    forwards gathered the parameters, which are let go again."""
    losses: list[torch.Tensor] = []
    for batch in held_out:
        losses += executor.evaluate(split(_graph_values(plan, *batch)))
    if fully_sharded:
        end_of_step(list(modules.values()))
    return losses


def _fully_shard(stages: dict[int, StageRuntime], plan: Plan, executor: Executor, device_mesh: Any) -> bool:
    """Shard this rank's stages over the data-parallel group under ZeRO-2/3; whether it did."""
    split_backward = any(action.kind is Kind.I for action in executor.actions)
    refused = check_level(plan.zero, dp=plan.mesh["dp"], split_backward=split_backward)
    if refused:
        raise ConfigError(refused)
    if plan.zero not in FSDP_LEVELS:
        return False
    for stage in stages.values():
        shard_stage(stage.module, device_mesh["dp"], plan.zero, working_dtype(plan.dtype))
    return True


def _executor(out_dir: Path, plan: Plan, schedule: Schedule, args: argparse.Namespace, rank: int,
              device: torch.device, device_mesh: DeviceMesh, data_parallel: Any = None
              ) -> tuple[dict[int, StageRuntime], Executor]:
    """This rank's stages and the executor that runs its action list of the plan's schedule: its
    messages split over its tensor-parallel group (`autopart.ir.scatter_gather`), and with
    replicas the data-parallel all-reduce of each bucket launched as its gradients become final
    (`autopart.runtime.reducer`), unless FSDP reduces them (ZeRO-2/3)."""
    mesh = Mesh.of(plan)
    here = mesh.coordinates(rank)
    schedule_spec = plan.schedule
    stage_count = len(plan.stages)
    # a group per kind of message and direction (autopart.runtime.p2p); every rank makes them
    channels = Channels.made(datetime.timedelta(seconds=args.timeout)) if mesh.pp > 1 else None
    split_backward = any(action.kind is Kind.I for action in schedule[here.pp])
    stages = _stages_here(out_dir, plan, args, rank, device, split_backward=split_backward)
    reducer = None
    if data_parallel is not None and plan.zero not in FSDP_LEVELS:
        reducer = GradientReducer(
            modules={s: stage.module for s, stage in stages.items()},
            orders={s: plan.stages[s].parameters for s in stages},
            actions=schedule[here.pp], group=data_parallel, size=mesh.dp,
        )  # fmt: skip
    executor = Executor(
        rank=here.pp,
        stages=stages,
        last_stage=stage_count - 1,
        schedule=schedule,
        microbatches=schedule_spec.microbatches,
        device=device,
        scatter=Scatter(group_of(device_mesh, "tp"), here.tp, mesh.tp) if mesh.tp > 1 else None,
        reducer=reducer,
        channels=channels,
        global_rank=rank,
        replicas=(data_parallel, mesh.dp) if data_parallel is not None else None,
    )
    executor.connect()  # every channel's communicators, in one order on all ranks
    return stages, executor


def _stages_here(out_dir: Path, plan: Plan, args: argparse.Namespace, rank: int, device: torch.device, *,
                 split_backward: bool) -> dict[int, StageRuntime]:
    """The stages this rank runs, loaded with their weights and wired to their pipeline peers."""
    mesh = Mesh.of(plan)
    here = mesh.coordinates(rank)
    stage_count = len(plan.stages)
    stages: dict[int, StageRuntime] = {}
    for stage_plan in plan.stages:
        if stage_plan.rank != here.pp:
            continue
        s = stage_plan.index
        peer = lambda stage: mesh.pipeline_peers(rank, plan.stages[stage].rank)  # noqa: E731
        module = load_stage(
            out_dir, s, device, tp_rank=here.tp, tp=mesh.tp, weights=args.weights, placements=stage_plan.parameter_placements
        )  # fmt: skip
        stages[s] = StageRuntime(
            index=s,
            module=module,
            forward=StageForward(
                module, recompute=stage_plan.recompute, dtype=plan.dtype, device=device, split_backward=split_backward,
                dropout=not args.no_dropout,
            ),
            inputs=[meta for _, meta in stage_plan.inputs],
            output_metas=[meta for _, meta in stage_plan.outputs],
            input_gradients=takes_gradient(stage_plan.inputs, stage_plan.no_grad_inputs),
            output_gradients=takes_gradient(stage_plan.outputs, plan.stages[s + 1].no_grad_inputs if s < stage_count - 1 else ()),
            batch_inputs=[plan.graph_inputs.index(name) for name in stage_plan.batch_inputs],
            prev_rank=peer(s - 1) if s > 0 else None,
            next_rank=peer(s + 1) if s < stage_count - 1 else None,
        )
    return stages


def _mean_loss(losses: list[torch.Tensor], data_parallel: Any, dp: int) -> torch.Tensor:
    """The mean over the global batch, of the microbatch losses held here (pipeline's last stage,
    tp 0): a one-element fp64 tensor on the device, which the reporter alone reads."""
    loss = torch.stack(losses).to(torch.float64).mean().reshape(1)
    if data_parallel is not None:
        dist.all_reduce(loss, group=data_parallel)
    return loss / dp


def _shares(values: tuple, dp: int, dp_rank: int, microbatches: int) -> list[tuple]:
    share = split_microbatches(values, dp)[dp_rank]  # this replica's share of the global batch
    return split_microbatches(share, microbatches)


def _save(checkpointing: CheckpointContext, steps_done: int, rank: int) -> None:
    """A checkpoint saved; a peer that dies during it (or a full disk) ends this rank as a failed
    action does, in one line that says where it was, not in the collective library's traceback.
    The half-written folder is left for the next resume to pass over."""
    inject_failure(rank, steps_done - 1, saving=True)
    try:
        checkpointing.save(steps_done)
    except (RuntimeError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise StepFailure(f"rank {rank}, saving the checkpoint after step {steps_done - 1}: "
                          f"{type(exc).__name__}: {first}") from None


def _write_trace(clock: StepClock, plan: Plan, args: argparse.Namespace, step: int) -> None:
    """The measured timeline of ``step`` as a Chrome trace, drawn for the first pipeline's ranks."""
    mesh = Mesh.of(plan)
    name = Path(plan.provenance.model_file).name
    title = f"measured: {name}, {plan.schedule.kind}, pp={mesh.pp}, step {step}"

    def drawn(r: int) -> int | None:
        where = mesh.coordinates(r)
        return where.pp if where.dp == 0 and where.tp == 0 else None

    timeline = write_measured_trace(
        clock, ranks=mesh.pp, path=args.trace, title=title, pipeline_rank=drawn
    )
    if timeline is not None:
        print(f"wrote {args.trace}: step {step} measured {timeline.step_s * 1e3:.3f} ms, "
              f"bubble {timeline.bubble:.1%}", flush=True)


def _save_weights(folder: Path, stages: dict[int, StageRuntime], here: Coordinates, tp: int, digest: str) -> None:
    """Each stage's trained weights, in the files the output directory's weights/ uses, written
    by the first data-parallel replica; every replica gathers them whole first (ZeRO-2/3). Each
    names its plan (``digest``), so that a later run replaces it only as this plan's own
    (`check_weights_folder`)."""
    states = {s: full_state(stage.module) for s, stage in stages.items()}
    if here.dp != 0:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for s, state in states.items():
        state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        save_tensors(state, folder / weights_file_name(s, here.tp, tp), {PLAN_HASH_KEY: digest})


def _graph_values(plan: Plan, inputs: tuple, target: Any) -> tuple:
    """A batch as the graph's inputs: the model's inputs, then the target when there is a loss_fn."""
    return (*inputs, target) if len(plan.graph_inputs) > len(inputs) else tuple(inputs)

