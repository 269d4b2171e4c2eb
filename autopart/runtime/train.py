"""The training loop that every generated ``train.py`` runs, one process per rank under torchrun.

    torchrun --nproc-per-node P OUT/train.py [--steps N] [--lr LR] [--optimizer sgd|adamw]
        [--seed S] [--metrics FILE] [--save-weights DIR] [--timeout S] [--weights CKPT.safetensors]

Each rank builds its stage from ``stages/stage_<k>.py`` and ``weights/stage_<k>.safetensors``
(or, with ``--weights CKPT``, the stage's tensors of a whole-model safetensors checkpoint; or,
for a model built on the meta device, the model's initialisers run for the stage's tensors),
draws the same global batches as every other rank, runs its action list of the plan's schedule,
sums the gradients of parameters that several stages hold (tied embeddings), and steps its
optimizer. NCCL when CUDA is present, gloo otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from autopart.capture import load_model_file
from autopart.errors import AutopartError, ConfigError
from autopart.plan import Plan, load_plan
from autopart.runtime.data import global_batches, split_microbatches
from autopart.runtime.executor import Executor, StageRuntime
from autopart.runtime.optim import OPTIMIZERS, make_optimizer
from autopart.runtime.stage import check_checkpoint, load_stage, stage_names
from autopart.schedule import add_communication, build_schedule, stage_rank

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None, plan: Plan) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train.py", description="Train the compiled model (run under torchrun).")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=plan.optimizer)
    parser.add_argument("--seed", type=int, default=0, help="seed of the training batches (default 0)")
    parser.add_argument("--metrics", type=Path, help="append one JSON line per step: step, loss, step_s")
    parser.add_argument("--save-weights", type=Path, help="write each stage's final weights here (safetensors)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck peer is an error")
    parser.add_argument(
        "--weights", type=Path, help="initial weights: a safetensors file of the model, read by parameter name"
    )
    return parser.parse_args(argv)


def _model_file(out_dir: Path, plan: Plan) -> Path:
    copied = out_dir / "model.py"
    original = Path(plan.provenance.model_file)
    # the copy keeps OUT self-contained; the original's folder stays importable for its siblings
    if original.parent.is_dir():
        sys.path.append(str(original.parent))
    return copied


def main(out_dir: str | Path, argv: list[str] | None = None) -> None:
    out_dir = Path(out_dir).resolve()
    try:
        _train(out_dir, argv)
    except AutopartError as exc:
        print(f"autopart: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _train(out_dir: Path, argv: list[str] | None) -> None:
    plan = load_plan(out_dir / "plan.json")
    args = parse_args(argv, plan)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != plan.world_size:
        raise ConfigError(
            f"the plan needs {plan.world_size} processes but {world_size} were started; "
            f"run torchrun --nproc-per-node {plan.world_size} {out_dir / 'train.py'}"
        )
    model_file = _model_file(out_dir, plan)
    if args.weights is not None:  # refuse a checkpoint that lacks this rank's tensors before any peer waits
        for stage_plan in plan.stages:
            if stage_plan.rank == rank:
                check_checkpoint(args.weights, stage_names(out_dir, stage_plan.index), stage_plan.index)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        _loop(out_dir, plan, args, rank, device, model_file)
    finally:
        dist.destroy_process_group()


def _loop(
    out_dir: Path, plan: Plan, args: argparse.Namespace, rank: int, device: torch.device, model_file: Path
) -> None:
    pipeline = plan.mesh["pp"]
    schedule_spec = plan.schedule
    stage_count = len(plan.stages)
    stages: dict[int, StageRuntime] = {}
    for stage_plan in plan.stages:
        if stage_plan.rank != rank:
            continue
        s = stage_plan.index
        stages[s] = StageRuntime(
            index=s,
            module=load_stage(out_dir, s, device, weights=args.weights),
            inputs=[meta for _, meta in stage_plan.inputs],
            batch_inputs=[plan.graph_inputs.index(name) for name in stage_plan.batch_inputs],
            prev_rank=stage_rank(s - 1, pipeline) if s > 0 else None,
            next_rank=stage_rank(s + 1, pipeline) if s < stage_count - 1 else None,
        )
    # every rank creates every group, in the same order, as torch.distributed requires
    tied_groups = []
    for name, holders in sorted(plan.tied_parameters.items()):
        ranks = sorted({plan.stages[s].rank for s in holders})
        group = dist.new_group(ranks)
        if rank in ranks:
            tied_groups.append((name, group))
    schedule = add_communication(
        build_schedule(
            schedule_spec.kind, ranks=pipeline, microbatches=schedule_spec.microbatches, chunks=schedule_spec.chunks
        ),
        ranks=pipeline,
    )
    executor = Executor(
        rank=rank,
        stages=stages,
        last_stage=stage_count - 1,
        schedule=schedule,
        microbatches=schedule_spec.microbatches,
        device=device,
    )
    parameters = [p for stage in stages.values() for p in stage.module.parameters()]
    optimizer = make_optimizer(args.optimizer, parameters, args.lr)
    spec = load_model_file(model_file, build=False)
    data = global_batches(spec, schedule_spec.global_batch_size, args.seed)
    holds_loss = stage_count - 1 in stages
    for step in range(args.steps):
        inputs, target = next(data)
        values = (*inputs, target) if len(plan.graph_inputs) > len(inputs) else tuple(inputs)
        start = time.perf_counter()
        losses = executor.step(split_microbatches(values, schedule_spec.microbatches))
        for name, group in tied_groups:
            _sum_tied_gradients(stages, name, group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if holds_loss:
            loss = sum(losses) / len(losses)
            print(f"step {step} loss {loss:.6f} step_s {elapsed.item():.4f}", flush=True)
            if args.metrics:
                with open(args.metrics, "a") as metrics:
                    metrics.write(json.dumps({"step": step, "loss": loss, "step_s": elapsed.item()}) + "\n")
    if args.save_weights:
        args.save_weights.mkdir(parents=True, exist_ok=True)
        for s, stage in stages.items():
            state = {k: v.detach().cpu().contiguous() for k, v in stage.module.state_dict().items()}
            save_file(state, str(args.save_weights / f"stage_{s}.safetensors"))


def _sum_tied_gradients(stages: dict[int, StageRuntime], name: str, group: dist.ProcessGroup) -> None:
    """Every copy of a parameter held by several stages gets the sum of all copies' gradients."""
    copies = [p for stage in stages.values() for n, p in stage.module.named_parameters() if n == name]
    total = torch.zeros_like(copies[0])
    for copy in copies:
        if copy.grad is not None:
            total += copy.grad
    dist.all_reduce(total, group=group)
    for copy in copies:
        copy.grad = total.clone()
