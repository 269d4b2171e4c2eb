"""autopart's generated programs against PyTorch's own pipeline runtime, on CPU with gloo.

    PYTHONPATH=. python benchmarks/runtime_vs_torch.py [--ranks 2] [--repeats 5] [--steps 30]

(a, b) The same model, the same stage split and the same schedule, run as autopart's generated
programs (``torchrun OUT/train.py``) and as ``torch.distributed.pipelining`` (``PipelineStage``
with ``ScheduleGPipe`` / ``Schedule1F1B``). torch's stages are autopart's own generated stage
modules (``OUT/stages/stage_k.py`` with ``OUT/weights/stage_k.safetensors``), so the two runs do
exactly the same arithmetic; what differs is only the runtime that drives them. The losses of
both runs are compared step by step, and a mismatch stops the benchmark.

How autopart's stages are fitted to torch's API, and why this is fair:
- autopart's stages read the batch values they need (``idx`` on the first stage, ``target`` on
  the last) straight from the batch, as every rank draws the same batches. torch passes
  ``schedule.step(*args, **kwargs)`` to the first stage as arguments, and *keyword* arguments
  to every stage, split into microbatches. So every rank calls ``schedule.step`` with the batch
  values its stage reads as keywords (renamed ``batch_<name>``, since ``target=`` is the
  schedule's own parameter), and a thin wrapper passes them on: nothing extra is sent between
  ranks, on either side.
- autopart's last stage returns the loss itself; torch computes the loss with ``loss_fn(output,
  target)``. The ``loss_fn`` given to torch's schedule returns the stage's output (already the
  loss). torch scales the gradients by 1/M after the backward, autopart scales each loss by 1/M
  before it: the same gradients. ``return_outputs=False``: autopart does not merge the outputs.
- Both sides time a step the same way: from before the schedule to after ``optimizer.step()``
  and ``zero_grad()`` (including the all-reduce of tied embeddings' gradients), the max over ranks.
  The same optimizer (AdamW, ``foreach=False``), the same batches, the same initial weights.

(c) On the large-vocabulary-head model (``tests/models/big_head.py``): autopart's own cuts run
by its generated programs, against torch.distributed.pipelining split at equal layer counts
(what ``uniform_layer_cuts`` gives: the embedding on the first stage, the head on the last) and
against autopart's runtime on that equal-layer split. The predicted margin is the ratio of the
two plans' predicted step times; the measured one the ratio of measured medians.

Single-process training (one process, the original eager model, the same batches and optimizer)
is the reference line. Every launch has a timeout; each runs ``--steps`` steps and its first
``--warmup`` are dropped; a run's figure is the median of its steps, a configuration's the
median of ``--repeats`` runs, with autopart and torch alternated. ``OMP_NUM_THREADS=1`` per rank.
The last line is ``ratio autopart/torch = X``: the geometric mean, over the same-split
configurations, of autopart's median step time over torch's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autopart.tools.local_run import free_port
from autopart.runtime.pipelining import loss_is_the_output

REPO = Path(__file__).resolve().parent.parent
GPT = REPO / "examples" / "gpt.py"
BIG_HEAD = REPO / "tests" / "models" / "big_head.py"
LAUNCH_TIMEOUT_S = 300


# ---------------------------------------------------------------- the torch.distributed.pipelining side


class BatchByKeyword(nn.Module):
    """An autopart stage under torch's API: batch values arrive as ``batch_<name>`` keywords."""

    def __init__(self, stage: nn.Module, batch_inputs: tuple[str, ...]):
        super().__init__()
        self.stage = stage
        self.batch_inputs = batch_inputs

    def forward(self, *received: torch.Tensor, **batch: torch.Tensor):
        return self.stage(*received, **{name: batch[f"batch_{name}"] for name in self.batch_inputs})


def batch_keywords(graph_inputs: tuple[str, ...], values: tuple, batch_inputs: tuple[str, ...]) -> dict:
    """The keyword arguments of one rank's ``schedule.step``: the batch values its stage reads."""
    by_name = dict(zip(graph_inputs, values, strict=True))
    return {f"batch_{name}": by_name[name] for name in batch_inputs}


def _tied_groups(plan, rank: int, module: nn.Module) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
    """Parameters that several stages hold (tied embeddings), with the group that sums their gradients."""
    tied = []
    for name, holders in sorted(plan.tied_parameters.items()):
        ranks = sorted({plan.stages[s].rank for s in holders})
        group = dist.new_group(ranks)  # every rank creates every group, in the same order
        if rank in ranks:
            tied.append((dict(module.named_parameters())[name], group))
    return tied


class TorchPipeline:
    """One rank of torch.distributed.pipelining, running autopart's stage module of that rank."""

    def __init__(self, out_dir: Path, plan, rank: int, world: int, lr: float):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from autopart.runtime.optim import make_optimizer
        from autopart.runtime.stage import load_stage

        assert plan.schedule.chunks == 1 and plan.stages[rank].rank == rank, "one stage per rank"
        self.plan, self.batch_inputs, self.last = plan, plan.stages[rank].batch_inputs, rank == world - 1
        module = load_stage(out_dir, rank, torch.device("cpu"))
        stage = PipelineStage(BatchByKeyword(module, self.batch_inputs), rank, world, torch.device("cpu"))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[plan.schedule.kind]
        self.schedule = kind(stage, n_microbatches=plan.schedule.microbatches, loss_fn=loss_is_the_output)
        self.tied = _tied_groups(plan, rank, module)
        self.optimizer = make_optimizer(plan.optimizer, module.parameters(), lr)

    def step(self, values: tuple, target) -> list[float]:
        keywords = batch_keywords(self.plan.graph_inputs, values, self.batch_inputs)
        losses: list[torch.Tensor] = []
        if self.last:
            self.schedule.step(target=target, losses=losses, return_outputs=False, **keywords)
        else:
            self.schedule.step(return_outputs=False, **keywords)
        for parameter, group in self.tied:
            dist.all_reduce(parameter.grad, group=group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return [x.item() for x in losses]


class AutopartPipeline:
    """autopart's executor on the same stage, built as the generated ``train.py`` builds it (paired mode)."""

    def __init__(self, out_dir: Path, plan, rank: int, world: int, lr: float):
        from autopart.runtime.executor import Executor, StageRuntime
        from autopart.runtime.optim import make_optimizer
        from autopart.runtime.stage import load_stage
        from autopart.schedule import add_communication, build_schedule

        stage_plan, microbatches = plan.stages[rank], plan.schedule.microbatches
        module = load_stage(out_dir, rank, torch.device("cpu"))
        runtime = StageRuntime(
            index=rank, module=module, inputs=[meta for _, meta in stage_plan.inputs],
            batch_inputs=[plan.graph_inputs.index(name) for name in stage_plan.batch_inputs],
            prev_rank=rank - 1 if rank > 0 else None, next_rank=rank + 1 if rank < world - 1 else None,
        )  # fmt: skip
        schedule = build_schedule(plan.schedule.kind, ranks=world, microbatches=microbatches, chunks=1)
        self.executor = Executor(
            rank=rank, stages={rank: runtime}, last_stage=world - 1, schedule=add_communication(schedule, ranks=world),
            microbatches=microbatches, device=torch.device("cpu"),
        )  # fmt: skip
        self.microbatches = microbatches
        self.tied = _tied_groups(plan, rank, module)
        self.optimizer = make_optimizer(plan.optimizer, module.parameters(), lr)

    def step(self, values: tuple, target) -> list[float]:
        from autopart.runtime.data import split_microbatches

        losses = [loss.item() for loss in self.executor.step(split_microbatches(values, self.microbatches))]
        for parameter, group in self.tied:
            dist.all_reduce(parameter.grad, group=group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses


def pipeline_worker(out_dir: Path, steps: int, metrics: Path, seed: int, lr: float, *, paired: bool) -> None:
    """Under torchrun: torch's runtime alone, or (paired) torch's and autopart's, alternated step by step."""
    from autopart.ir.model_file import load_model_file
    from autopart.ir.plan import load_plan
    from autopart.runtime.data import global_batches

    plan = load_plan(out_dir / "plan.json")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        runtimes = {"torch": TorchPipeline(out_dir, plan, rank, world, lr)}
        if paired:
            runtimes["autopart"] = AutopartPipeline(out_dir, plan, rank, world, lr)
        spec = load_model_file(out_dir / "model.py", build=False)
        data = global_batches(spec, plan.schedule.global_batch_size, seed)
        for step in range(steps):
            inputs, target = next(data)
            values = (*inputs, target) if len(plan.graph_inputs) > len(inputs) else tuple(inputs)
            order = list(runtimes.items()) if step % 2 == 0 else list(reversed(runtimes.items()))
            for name, runtime in order:
                if paired:
                    dist.barrier()  # each timed step starts together on every rank
                start = time.perf_counter()
                losses = runtime.step(values, target)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if losses:
                    row = {"step": step, "runtime": name, "loss": sum(losses) / len(losses), "step_s": elapsed.item()}
                    with open(metrics, "a") as file:
                        file.write(json.dumps(row) + "\n")
        dist.barrier()  # leave together: gloo can abort a rank whose peer closed first
    finally:
        dist.destroy_process_group()


def single_worker(out_dir: Path, steps: int, metrics: Path, seed: int, lr: float) -> None:
    """The reference: the original model, eager, in one process, on the same batches."""
    from autopart.ir.model_file import eager_loss, load_model_file
    from autopart.ir.plan import load_plan
    from autopart.runtime.data import global_batches
    from autopart.runtime.optim import make_optimizer
    from autopart.runtime.reference import initial_weights

    plan = load_plan(out_dir / "plan.json")
    spec = load_model_file(out_dir / "model.py")
    named = dict(spec.module.named_parameters()) | dict(spec.module.named_buffers())
    with torch.no_grad():
        for name, value in initial_weights(out_dir).items():
            named[name].copy_(value)
    optimizer = make_optimizer(plan.optimizer, spec.module.parameters(), lr)
    data = global_batches(spec, plan.schedule.global_batch_size, seed)
    for step in range(steps):
        inputs, target = next(data)
        start = time.perf_counter()
        loss = eager_loss(spec, inputs, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        with open(metrics, "a") as file:
            file.write(json.dumps({"step": step, "loss": loss.item(), "step_s": elapsed}) + "\n")


# ---------------------------------------------------------------- compiling the plans compared


def compile_plan(model: Path, out: Path, *, pp: int, microbatches: int, micro_batch_size: int, schedule: str):
    from autopart.driver import CompileOptions, compile_to_directory
    from autopart.ir.plan import load_plan

    if (out / "plan.json").exists():  # compiled by an earlier run with the same --work
        return load_plan(out / "plan.json")
    options = CompileOptions(
        model=model, pp=pp, microbatches=microbatches, micro_batch_size=micro_batch_size, schedule=schedule
    )
    return compile_to_directory(options, out)[0]


def pinned_variant(plan, out: Path, *, schedule: str | None = None, cuts: tuple[int, ...] | None = None):
    """Emit ``plan`` again with another schedule and/or other cuts (a pinned, hand-edited plan)."""
    from autopart.driver import CompileOptions, compile_to_directory
    from autopart.passes.front import build_front
    from autopart.ir.plan import load_plan
    from autopart.solve.pipeline import stage_ranges

    if (out / "plan.json").exists():  # emitted by an earlier run with the same --work
        return load_plan(out / "plan.json")

    data = plan.to_json()
    if schedule is not None:
        data["schedule"]["kind"] = schedule
    if cuts is not None:
        front = build_front(CompileOptions(model=Path(plan.provenance.model_file)), plan.schedule.micro_batch_size)
        blocks = front.chain.blocks
        for stage, blocks_range in zip(data["stages"], stage_ranges(cuts, len(blocks)), strict=True):
            stage["nodes"] = [n for k in blocks_range for n in blocks[k].nodes]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        path.write_text(json.dumps(data))
        options = CompileOptions(model=Path(plan.provenance.model_file), plan=path)
        return compile_to_directory(options, out)[0]


def equal_layer_cuts(plan) -> tuple[int, ...]:
    from autopart.driver import CompileOptions
    from autopart.passes.front import build_front
    from autopart.solve.baselines import uniform_layer_cuts

    front = build_front(CompileOptions(model=Path(plan.provenance.model_file)), plan.schedule.micro_batch_size)
    return uniform_layer_cuts(front.chain, plan.mesh["pp"])


def layers_per_stage(plan) -> str:
    """The repeated layers (``h.N``) each stage holds parameters of; a layer cut inside shows on both."""
    import re

    parts = []
    for stage in plan.stages:
        found = sorted({int(m.group(1)) for p in stage.parameters if (m := re.match(r"^h\.(\d+)\.", p))})
        parts.append(f"h.{found[0]}-{found[-1]}" if found else "-")
    return " / ".join(parts)


# ---------------------------------------------------------------- launching and measuring


@dataclass(frozen=True, kw_only=True)
class Run:
    step_s: float  # median over the steps after the warm-up
    losses: list[float]


def launch(runtime: str, out: Path, *, nproc: int, steps: int, warmup: int) -> dict[str, Run]:
    """One timed launch: ``autopart`` (OUT/train.py), ``torch``, ``paired`` or ``single`` (this file's workers)."""
    # examples/: big_head.py imports gpt from a path relative to itself, which OUT/model.py (its copy) lacks
    path = os.pathsep.join([str(REPO), str(REPO / "examples"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "metrics.jsonl"
        common = ["--steps", str(steps), "--metrics", str(metrics)]
        if runtime == "autopart":
            program = [str(out / "train.py"), "--timeout", "120", *common]
        else:
            program = [str(Path(__file__).resolve()), runtime, str(out), *common]
        if runtime == "single":
            command = [sys.executable, *program]
        else:
            command = [
                sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}", *program,
            ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"{runtime} run failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    runs = {}
    for name in dict.fromkeys(row.get("runtime", runtime) for row in rows):
        mine = [row for row in rows if row.get("runtime", runtime) == name]
        step_s = statistics.median(row["step_s"] for row in mine[warmup:])
        runs[name] = Run(step_s=step_s, losses=[row["loss"] for row in mine])
    return runs


def alternate(outs: dict[str, tuple[str, Path]], *, nproc: int, repeats: int, steps: int, warmup: int) -> dict[str, list[Run]]:
    """``repeats`` rounds, each launching every entry once, in turn: noise hits them alike."""
    runs: dict[str, list[Run]] = {key: [] for key in outs}
    for _ in range(repeats):
        for key, (runtime, out) in outs.items():
            runs[key].append(launch(runtime, out, nproc=nproc, steps=steps, warmup=warmup)[runtime])
    return runs


def median_ms(runs: list[Run]) -> float:
    return 1e3 * statistics.median(r.step_s for r in runs)


def same_losses(a: list[Run], b: list[Run]) -> float:
    """The largest difference between the two runtimes' step losses; they must train alike."""
    difference = max(abs(x - y) for x, y in zip(a[0].losses, b[0].losses))  # the shorter run's steps
    if difference > 1e-4:
        raise RuntimeError(f"the two runtimes' losses differ by {difference:.2e}: they do not compute the same step")
    return difference


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# ---------------------------------------------------------------- the benchmark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="pipeline sizes of (a, b) (default 2)")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
    parser.add_argument("--repeats", type=int, default=5, help="launches per configuration (default 5)")
    parser.add_argument("--steps", type=int, default=30, help="steps per launch (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of a launch not counted (default 5)")
    parser.add_argument("--big-head-ranks", type=int, default=2, help="pipeline size of (c) (default 2)")
    parser.add_argument("--skip-big-head", action="store_true", help="only (a, b)")
    parser.add_argument("--skip-same-split", action="store_true", help="only (c)")
    parser.add_argument("--work", type=Path, help="where the compiled programs go (default: a temporary folder)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="autopart-bench-"))
    measure = dict(repeats=args.repeats, steps=args.steps, warmup=args.warmup)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, load average at start {load_average()}", flush=True)

    same_rows, ratios = [], []
    for ranks in [] if args.skip_same_split else args.ranks:
        base = compile_plan(GPT, work / f"gpt-pp{ranks}-gpipe", pp=ranks, microbatches=2 * ranks, micro_batch_size=2, schedule="gpipe")
        for kind in args.schedules:
            out = work / f"gpt-pp{ranks}-{kind}"
            plan = base if kind == "gpipe" else pinned_variant(base, out, schedule=kind)
            runs = alternate({"autopart": ("autopart", out), "torch": ("torch", out)}, nproc=ranks, **measure)
            difference = same_losses(runs["autopart"], runs["torch"])
            ours, theirs = median_ms(runs["autopart"]), median_ms(runs["torch"])
            paired = launch("paired", out, nproc=ranks, steps=2 * args.steps, warmup=2 * args.warmup)
            same_losses([paired["autopart"]], runs["autopart"]), same_losses([paired["torch"]], runs["torch"])
            paired_ours, paired_theirs = median_ms([paired["autopart"]]), median_ms([paired["torch"]])
            ratios.append(ours / theirs)
            same_rows.append([
                f"gpt.py, {ranks} ranks, {kind}, {plan.schedule.microbatches} mb", layers_per_stage(plan),
                f"{ours:.2f}", f"{theirs:.2f}", f"**{ours / theirs:.3f}**",
                f"{paired_ours:.2f}", f"{paired_theirs:.2f}", f"{paired_ours / paired_theirs:.3f}", f"{difference:.1e}",
            ])  # fmt: skip
            print(f"  done {same_rows[-1][0]} (load {load_average()})", flush=True)
    if same_rows:
        single = alternate({"single": ("single", work / f"gpt-pp{args.ranks[0]}-gpipe")}, nproc=1, **measure)["single"]

    big_rows, margin_line = [], ""
    if not args.skip_big_head:
        ranks = args.big_head_ranks
        own = compile_plan(BIG_HEAD, work / "big-own", pp=ranks, microbatches=8, micro_batch_size=2, schedule="1f1b")
        cached = (work / "big-equal" / "plan.json").exists()
        equal = pinned_variant(own, work / "big-equal", cuts=None if cached else equal_layer_cuts(own))
        runs = alternate(
            {"own": ("autopart", work / "big-own"), "torch": ("torch", work / "big-equal"), "equal": ("autopart", work / "big-equal")},
            nproc=ranks, **measure,
        )  # fmt: skip
        same_losses(runs["torch"], runs["equal"])
        single_big = alternate({"single": ("single", work / "big-own")}, nproc=1, **measure)["single"]
        measured = {key: median_ms(value) for key, value in runs.items()}
        predicted_margin = equal.predicted.step_s / own.predicted.step_s
        big_rows = [
            ["autopart's cuts, autopart runtime", layers_per_stage(own), f"{1e3 * own.predicted.step_s:.2f}", f"{measured['own']:.2f}"],
            ["equal layers, torch.distributed.pipelining", layers_per_stage(equal), f"{1e3 * equal.predicted.step_s:.2f}", f"{measured['torch']:.2f}"],
            ["equal layers, autopart runtime", layers_per_stage(equal), f"{1e3 * equal.predicted.step_s:.2f}", f"{measured['equal']:.2f}"],
            ["single process (reference)", "all", "", f"{median_ms(single_big):.2f}"],
        ]  # fmt: skip
        margin_torch, margin_ours = measured["torch"] / measured["own"], measured["equal"] / measured["own"]
        margin_line = (
            f"predicted speed-up of autopart's cuts over equal layers: {predicted_margin:.3f}x; measured: "
            f"{margin_torch:.3f}x against torch.distributed.pipelining, {margin_ours:.3f}x on autopart's runtime "
            f"(within ±10% of the prediction: {abs(margin_torch / predicted_margin - 1) <= 0.1})"
        )

    print(f"\nload average at end {load_average()}; {args.repeats} alternated launches of {args.steps} steps each "
          f"(first {args.warmup} dropped), medians; step time in ms, max over ranks\n")  # fmt: skip
    if same_rows:
        print("Same stage split and schedule (a: autopart's generated programs, b: torch.distributed.pipelining):\n")
        print(table([
            "configuration", "layers/stage", "autopart ms", "torch ms", "autopart/torch",
            "paired: autopart ms", "torch ms", "autopart/torch", "max loss diff",
        ], same_rows))  # fmt: skip
        print("\n(paired: one launch running both runtimes on the same stages, alternated step by step: the same load for both)")
        print(f"\nsingle process, same model and global batch: {median_ms(single):.2f} ms")
    if big_rows:
        print(f"\nLarge vocabulary head (big_head.py, {args.big_head_ranks} ranks, 1f1b, 8 microbatches of 2):\n")
        print(table(["plan and runtime", "layers/stage", "predicted ms", "measured ms"], big_rows))
        print(f"\n{margin_line}")
    if ratios:
        geometric = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"ratio autopart/torch = {geometric:.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("torch", "paired", "single"):
        worker = argparse.ArgumentParser()
        worker.add_argument("runtime")
        worker.add_argument("out", type=Path)
        worker.add_argument("--steps", type=int, required=True)
        worker.add_argument("--metrics", type=Path, required=True)
        worker.add_argument("--seed", type=int, default=0)
        worker.add_argument("--lr", type=float, default=1e-3)
        w = worker.parse_args()
        if w.runtime == "single":
            single_worker(w.out.resolve(), w.steps, w.metrics, w.seed, w.lr)
        else:
            pipeline_worker(w.out.resolve(), w.steps, w.metrics, w.seed, w.lr, paired=w.runtime == "paired")
    else:
        main()
