"""How wrong are the cost models? Predicted against measured on this machine.

    python benchmarks/cost_accuracy.py [--steps 40] [--seconds 8] [--warmup 5] [--costs COSTS.json]
        [--rows gpt-s:2,gpt-s:2x2,...] [--repeats 1] [--shield]

For each example at two sizes and for 2 and 4 ranks: compile with profiled costs
(``--costs``: ops the database lacks are timed on the way), once with the ops' times alone and
once with ``--profile-pipeline`` (the programs run for a few steps first, and the stages'
compute inside the pipeline against alone scales every forward and backward: the "factor"
column), then measure
- forward+backward of one microbatch per stage, each stage run alone in this process (one thread);
- the median ``step_s`` that the generated program reports under torchrun (``--metrics``),
  warm-up steps left out, against the prediction profiled in the pipeline (``step err``) and
  the one from the ops alone (``err alone``); and the prediction against the median step of the
  profile's own run (``err in run``, the median over the repeats; "(k/N)" where the compile
  that followed the profile moved the cuts in N - k of them, whose plan did not run there):
  the step model on the steps it was built from, without the machine's drift to the next run;
- the peak resident memory per rank (``peak_memory_bytes`` in ``--metrics``);
and print each against the plan's prediction, with its error. ``--repeats N`` profiles the
pipeline afresh and runs it N times per row, one right after the other: the row shows the
repeat of the median step error, and every repeat's error beside it ("each repeat"), as the
machine moved between them. The 1-minute load average is
printed too: other work on the machine slows every measured figure and none of the predicted.
So is how far the machine's own speed moved between the profile and the run ("speed moved"):
the model's whole graph, forward and backward on one thread, timed for 2 s right before the
compile (which profiles that graph) and again right after the run; +10% means it ran 10% slower
after the run than before the profile. A virtual machine whose host is shared
moves by that much within a minute.
Run ``autopart profile-comm`` first, so that messages and the base memory of a rank are measured.

``--shield`` (root only) is for a machine that other sessions keep busy: Linux schedules each
session as a group (autogroup) and torchrun starts every rank in a session of its own, so the
ranks' ``nice`` does nothing against other sessions; ``--shield`` sets the scheduling group of
this process and of every rank to nice -19 instead, so that other sessions' work takes the
cores only while this job leaves them idle. It does not make the machine quiet: their work still
runs whenever a rank waits, and the hardware threads under the virtual cores may be shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autopart.predict.accuracy import OF_LAYOUT, PROFILED, Band, band_key, layout_of, write_band  # noqa: E402
from autopart.ir.model_file import load_model_file  # noqa: E402
from autopart.passes.capture import capture, graph_args  # noqa: E402
from autopart.driver import CompileOptions, compile_to_directory  # noqa: E402
from autopart.tools.local_run import free_port  # noqa: E402
from autopart.ir.plan import Plan  # noqa: E402
from autopart.profiling.in_situ import trimmed_mean  # noqa: E402
from autopart.runtime.stage import load_stage  # noqa: E402
from cost_models import CostDatabase  # noqa: E402

SIZES = {
    "gpt-s": ("gpt.py", "vocab_size=512, block_size=32, n_layer=4, n_head=4, n_embd=64"),
    "gpt-m": ("gpt.py", "vocab_size=1024, block_size=64, n_layer=6, n_head=4, n_embd=128"),
    "llama-s": ("llama.py", "vocab_size=384, seq_len=32, n_layer=4, n_head=4, n_kv_head=2, dim=64, ffn_dim=176"),
    "llama-m": ("llama.py", "vocab_size=768, seq_len=64, n_layer=6, n_head=4, n_kv_head=2, dim=128, ffn_dim=352"),
}
WRAPPER = """# {name}: examples/{example} with its CONFIG replaced (written by benchmarks/cost_accuracy.py)
import dataclasses, importlib.util
_spec = importlib.util.spec_from_file_location("_example_{slug}", {path!r})
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)
_base.CONFIG = dataclasses.replace(_base.CONFIG, {config})
build_model, example_batch, loss_fn = _base.build_model, _base.example_batch, _base.loss_fn
"""


def _model_file(folder: Path, name: str) -> Path:
    example, config = SIZES[name]
    path = folder / f"{name.replace('-', '_')}.py"
    path.write_text(WRAPPER.format(name=name, example=example, slug=name.replace("-", "_"),
                                   path=str(REPO / "examples" / example), config=config))
    return path


def _stage_times(out: Path, plan: Plan, seconds: float = 1.5) -> list[float]:
    """Forward+backward seconds of one microbatch per stage, each stage alone, one thread: the
    trimmed mean over ``seconds`` of runs, as the profiler takes it (`time_in_situ`: this CPU's
    speed flips every few seconds, and a median of a few runs catches one state)."""
    spec = load_model_file(out / "model.py" if (out / "model.py").exists() else plan.provenance.model_file, build=False)
    inputs, target = spec.example(plan.schedule.micro_batch_size)
    batch = (*inputs, target)
    modules = [load_stage(out, s.index, torch.device("cpu")) for s in plan.stages]
    received: list[torch.Tensor] = []
    times = []
    for stage, module in zip(plan.stages, modules):
        reads = [batch[plan.graph_inputs.index(n)] for n in stage.batch_inputs]
        samples = []
        i, started = 0, time.perf_counter()
        while i < 18 or time.perf_counter() - started < seconds:
            i += 1
            leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in received]
            start = time.perf_counter()
            out_value = module(*leaves, *reads)
            outs = [out_value] if isinstance(out_value, torch.Tensor) else list(out_value)
            floating = [t for t in outs if t.is_floating_point() and t.requires_grad]
            torch.autograd.backward(floating, [torch.ones_like(t) for t in floating])
            if i > 3:
                samples.append(time.perf_counter() - start)
        times.append(trimmed_mean(samples))
        received = [t.detach() for t in outs]
    return times


class _SpeedProbe:
    """The model's whole graph, forward and backward, on one thread: timed right before the
    compile (which profiles the same graph) and right after the run, it says how far this
    machine's speed moved between the profile and the measurement (see docs/cost_accuracy.md)."""

    def __init__(self, model: Path) -> None:
        spec = load_model_file(model)
        graph = capture(spec, batch_size=2)
        self.module = graph.module
        self.values = graph_args(graph, *spec.example(2))
        for _ in range(3):
            self.run()

    def run(self) -> None:
        self.module(*self.values).backward()  # the whole model's graph ends in its loss
        for parameter in self.module.parameters():
            parameter.grad = None

    def seconds(self, span: float = 2.0) -> float:
        samples, started = [], time.perf_counter()
        while len(samples) < 10 or time.perf_counter() - started < span:
            start = time.perf_counter()
            self.run()
            samples.append(time.perf_counter() - start)
        return trimmed_mean(samples)


def _shield(pid: int) -> None:
    """Scheduling group of ``pid`` to nice -19 (see --shield)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text("-19")
    except OSError:
        pass  # gone already, or not allowed: the measurement says what load it ran under


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _run(out: Path, ranks: int, steps: int, warmup: int, shield: bool = False) -> tuple[float, list[int]]:
    metrics = out / "metrics.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
               f"--master-port={port}", str(out / "train.py"), "--steps", str(steps), "--metrics", str(metrics)]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env) as launcher:
        if shield:  # the ranks appear as torchrun's children within a second or two
            deadline, shielded = time.time() + 30, set()
            while len(shielded) < ranks and time.time() < deadline and launcher.poll() is None:
                for child in set(_children(launcher.pid)) - shielded:
                    _shield(child)
                    shielded.add(child)
                time.sleep(0.05)
        _, stderr = launcher.communicate(timeout=600)
    if launcher.returncode != 0:
        raise RuntimeError(f"torchrun failed ({launcher.returncode}): {stderr.decode()[-2000:]}")
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return statistics.median(line["step_s"] for line in lines[warmup:]), lines[-1]["peak_memory_bytes"]


def _forget_pipelines(costs: Path) -> None:
    """Drop what ``--profile-pipeline`` stored, so that the next compile runs the pipeline again."""
    database = CostDatabase.load(costs)
    database.pipelines = {}
    database.save()


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="and more steps than --steps where it takes that many seconds of predicted steps")
    parser.add_argument("--costs", type=Path, help="cost database to use and extend (default: a fresh one)")
    parser.add_argument("--shield", action="store_true",
                        help="run this process and the ranks at scheduling-group nice -19 (root; see the docstring)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="profile and run each row this many times; the table shows the median error's")
    parser.add_argument("--rows", default="gpt-s:2,gpt-s:4,gpt-m:2,gpt-m:4,llama-s:2,llama-s:4,llama-m:2,llama-m:4")
    parser.add_argument("--default", action="store_true",
                        help="the default compile instead: no --costs, a fresh cache, the ops and messages it measures")
    parser.add_argument("--no-write", action="store_true",
                        help="do not record the error band in autopart/predict/accuracy.json (which compile prints)")
    args = parser.parse_args()
    if args.default:
        _default_path(args)
        return
    torch.set_num_threads(1)
    if args.shield:
        _shield(os.getpid())
    console = Console(highlight=False)
    table = Table(title="cost_accuracy: predicted vs measured on this CPU (errors: (predicted - measured) / measured)"
                        + (", --shield" if args.shield else ""))
    for header in ("model", "ranks", "stage fwd+bwd ms pred/meas (worst err)", "factor", "step ms pred",
                   "step ms meas", "step err", "each repeat", "err in run", "err alone", "speed moved", "peak MiB pred", "peak MiB meas", "mem err",
                   "load"):
        table.add_column(header, justify="right")
    with tempfile.TemporaryDirectory(prefix="cost_accuracy_") as folder:
        folder = Path(folder)
        costs = args.costs or folder / "costs.json"
        row_errors: list[float] = []  # per row, its median repeat's
        ran = []  # the rows' plans: the band covers their precisions
        for row in args.rows.split(","):
            name, pp, dp = _row(row)
            ranks = pp * dp
            model = _model_file(folder, name)
            probe = _SpeedProbe(model)
            before = probe.seconds()
            options = CompileOptions(model=model, pp=pp, dp=dp, microbatches=2 * pp, micro_batch_size=2, costs=costs,
                                     time_limit_s=10)
            alone, _ = compile_to_directory(options, folder / f"{row.replace(':', '-')}-alone")
            ran.append(alone)
            runs = []  # (plan, measured step, peaks) per repeat: profiled afresh, then run right after
            for repeat in range(args.repeats):
                _forget_pipelines(costs)
                plan, out = compile_to_directory(replace(options, profile_pipeline=True),
                                                 folder / f"{row.replace(':', '-')}-{repeat}")
                # the run right after the pipeline was profiled: this machine's speed moves within seconds
                steps = max(args.steps, args.warmup + math.ceil(args.seconds / plan.predicted.step_s))
                runs.append((plan, out, *_run(out, ranks, steps, args.warmup, shield=args.shield)))
            errors = [(p.predicted.step_s - step) / step for p, _, step, _ in runs]
            row_errors.append(sorted(errors)[len(errors) // 2])
            # against the profile's own run, where the compile kept the plan it ran: the model without the machine's drift
            in_run = [(p.predicted.step_s - p.predicted.profiled_step_s) / p.predicted.profiled_step_s
                      for p, *_ in runs if p.predicted.profiled_step_s is not None]
            in_run_cell = "-" if not in_run else f"{statistics.median(in_run):+.1%}" + (
                f" ({len(in_run)}/{len(runs)})" if len(in_run) < len(runs) else "")
            plan, out, step, peaks = runs[sorted(range(len(runs)), key=errors.__getitem__)[len(runs) // 2]]
            moved = probe.seconds() / before - 1
            measured_stages = _stage_times(out, plan)
            predicted_stages = [s.forward_s + s.backward_s for s in plan.stages]
            worst = max(zip(predicted_stages, measured_stages), key=lambda pm: abs(pm[0] - pm[1]) / pm[1])
            stage_cells = " ".join(f"{p * 1e3:.2f}/{m * 1e3:.2f}" for p, m in zip(predicted_stages, measured_stages))
            predicted_memory, measured_memory = max(plan.predicted.memory_bytes), max(peaks)
            factors = " ".join(f"{f:.2f}" for f in plan.predicted.compute_factor)
            table.add_row(name, row.split(":")[1], f"{stage_cells} ({_error(*worst)})", factors,
                          f"{plan.predicted.step_s * 1e3:.1f}", f"{step * 1e3:.1f}", _error(plan.predicted.step_s, step),
                          " ".join(f"{e:+.1%}" for e in errors), in_run_cell, _error(alone.predicted.step_s, step),
                          f"{moved:+.1%}",
                          f"{predicted_memory / 2**20:.0f}", f"{measured_memory / 2**20:.0f}",
                          _error(predicted_memory, measured_memory), f"{os.getloadavg()[0]:.1f}")
            console.print(f"{row}: step {plan.predicted.step_s * 1e3:.1f} ms predicted ({alone.predicted.step_s * 1e3:.1f} "
                          f"from the ops alone; pipeline {plan.predicted.pipeline_s * 1e3:.1f}, tails "
                          f"{' '.join(f'{t * 1e3:.1f}' for t in plan.predicted.rank_tail_s)}), {step * 1e3:.1f} ms measured")
    console.print(table)
    _write_band(args, band_key(PROFILED, "cpu"), row_errors, ran)


def _row(row: str) -> tuple[str, int, int]:
    """A ``--rows`` entry: ``MODEL:PP`` (a pipeline of PP ranks) or ``MODEL:PPxDP`` (PP stages on
    each of DP replicas; ``MODEL:1x2`` is data parallelism alone)."""
    name, _, layout = row.partition(":")
    pp, _, dp = layout.partition("x")
    return name, int(pp), int(dp or 1)


def _write_band(args: argparse.Namespace, key: str, errors: list[float], plans: list) -> None:
    """Record the band of this run's rows under the basis ``key``, where ``autopart compile`` reads
    it (see autopart/predict/accuracy.py), as the band of the precisions its ``plans`` (one per
    error) ran in: a compile in another (bf16 on this CPU) has none of its own, and says so. Rows
    of pipelines alone make the basis's band; those of each other layout their own (`OF_LAYOUT`)."""
    if not errors or args.no_write:
        return
    command = " ".join(["python", "benchmarks/cost_accuracy.py", *sys.argv[1:]])
    covers = tuple({f"{plan.provenance.device}/{plan.dtype}" for plan in plans})
    by_layout: dict[str, list[float]] = {}
    for plan, error in zip(plans, errors, strict=True):
        by_layout.setdefault(layout_of(plan), []).append(error)
    base = "pp" if "pp" in by_layout else min(by_layout)
    for layout, errors_of in sorted(by_layout.items()):
        band = Band.from_errors(errors_of, benchmark="cost_accuracy", command=command, covers=covers, layouts=(layout,))
        written = key if layout == base else f"{key}{OF_LAYOUT}{layout}"
        print(f"wrote the band of {layout} rows ({band.median:.1%} median, {band.worst:.1%} worst) as {written} "
              f"to {write_band(written, band)}")


def _default_path(args: argparse.Namespace) -> None:
    """Each row compiled as a new user compiles it (no flags past the layout), into a fresh cache
    (this run's temporary one: the first row measures the messages, every row its ops), then run
    ``--repeats`` times right after; the band is over every run."""
    console = Console(highlight=False)
    table = Table(title="cost_accuracy --default: the default compile's step against the run, fresh cache")
    for header in ("model", "ranks", "compile s", "step ms pred", "step ms meas (each run)", "errors", "load"):
        table.add_column(header, justify="right")
    errors: list[float] = []
    keys: set[str] = set()  # the bases the rows' predictions rest on: the band is theirs
    ran = []  # their plans, one per error: the bands cover their precisions and layouts
    with tempfile.TemporaryDirectory(prefix="cost_accuracy_default_") as folder:
        folder = Path(folder)
        os.environ["AUTOPART_CACHE_DIR"] = str(folder / "cache")
        for row in args.rows.split(","):
            name, pp, dp = _row(row)
            ranks = pp * dp
            options = CompileOptions(model=_model_file(folder, name), pp=pp, dp=dp, microbatches=2 * pp,
                                     micro_batch_size=2, time_limit_s=10)
            start = time.perf_counter()
            plan, out = compile_to_directory(options, folder / f"{row.replace(':', '-')}")
            compile_s = time.perf_counter() - start
            keys.add(plan.predicted.basis_key.partition(OF_LAYOUT)[0])  # its layout's band, where one is
            steps = max(args.steps, args.warmup + math.ceil(args.seconds / plan.predicted.step_s))
            measured = [_run(out, ranks, steps, args.warmup, shield=args.shield)[0] for _ in range(args.repeats)]
            row_errors = [(plan.predicted.step_s - m) / m for m in measured]
            errors += row_errors
            ran += [plan] * len(row_errors)  # one per error: each counts in its layout's band
            table.add_row(name, row.split(":")[1], f"{compile_s:.1f}", f"{plan.predicted.step_s * 1e3:.1f}",
                          " ".join(f"{m * 1e3:.1f}" for m in measured), " ".join(f"{e:+.1%}" for e in row_errors),
                          f"{os.getloadavg()[0]:.1f}")
            console.print(f"{row}: predicted {plan.predicted.step_s * 1e3:.1f} ms, measured "
                          f"{' '.join(f'{m * 1e3:.1f}' for m in measured)} ms")
    console.print(table)
    if len(keys) > 1:  # one band per basis: rows of two are not one band (a pipeline run failed, say)
        raise SystemExit(f"the rows rest on different bases ({', '.join(sorted(keys))}); no band written")
    if keys:
        _write_band(args, keys.pop(), errors, ran)


if __name__ == "__main__":
    main()
