"""What a new user sees first: the default compile's predicted step against the run, and the searched plan against its rivals.

    python benchmarks/first_run.py [--launches 3] [--steps 60] [--parts accuracy,search] [--searches gpt:2,llama:2,...] [--cache DIR]

Everything runs in a fresh cache (a temporary ``AUTOPART_CACHE_DIR``), as on a fresh clone, with
the default flags past the layout (``--cache DIR`` keeps the cache in DIR instead, and reuses what
it holds: two versions' predictions compared on the same measured messages and ops):

- accuracy: the README's quickstart (``examples/gpt.py --pp 2 --microbatches 4``) and
  ``examples/llama.py`` at ``--pp 2`` and ``--pp 4``: the predicted step against the median
  ``step_s`` of ``torchrun --nproc-per-node N OUT/train.py --steps S --metrics FILE`` (steps 5 to
  S), median of ``--launches`` launches, with their spread;
- search: ``--world-size N --global-batch-size B`` of each example (which runs its finalists
  here and keeps the fastest: ``autopart.profiling.finalists``); the chosen plan, each of the
  other finalists (pinned as the search described it), pure data parallelism (``--dp N``) and a
  single process, each launched ``--launches`` times: is the chosen plan within 10% of the fastest?

The 1-minute load average is printed with every row: other work on the machine slows every
measured figure and none of the predicted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autopart.driver import CompileOptions, compile_to_directory  # noqa: E402
from autopart.tools.local_run import free_port  # noqa: E402

WARMUP = 5
"""First steps left out of each launch's median."""
ACCURACY = (("quickstart gpt pp2 m4", "gpt.py", dict(pp=2, microbatches=4)),
            ("llama pp2", "llama.py", dict(pp=2)),
            ("llama pp4", "llama.py", dict(pp=4)))
LAYOUT = re.compile(r"pp(\d+) tp(\d+) dp(\d+) (\d+)x(\d+) (\S+)(?: v=(\d+))?(?: zero(\d?))?(?: (bf16))?$")
"""A layout as ``Layout.describe`` writes it; ZeRO-1 is ``zero``, levels 2 and 3 ``zero2`` and ``zero3``."""


def launch(out: Path, ranks: int, steps: int) -> float:
    """The median step of one ``torchrun`` launch of ``out/train.py`` (its first `WARMUP` steps left out)."""
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", str(out / "train.py"), "--steps", str(steps), "--metrics", str(metrics)]
    result = subprocess.run(command, capture_output=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})
    if result.returncode != 0:
        raise RuntimeError(f"torchrun failed ({result.returncode}): {result.stderr.decode()[-2000:]}")
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return statistics.median(line["step_s"] for line in lines[WARMUP:])


def launches(out: Path, ranks: int, steps: int, count: int) -> list[float]:
    return [launch(out, ranks, steps) for _ in range(count)]


def _cell(measured: list[float]) -> str:
    return f"{statistics.median(measured) * 1e3:.1f} ({min(measured) * 1e3:.1f}-{max(measured) * 1e3:.1f})"


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def accuracy(args: argparse.Namespace, folder: Path, console: Console) -> Table:
    table = Table(title=f"default compile, fresh cache: predicted step against the run (median of {args.launches} "
                        f"launches of {args.steps} steps, steps {WARMUP + 1}-{args.steps}; range in brackets)")
    for header in ("compile", "compile s", "predicted ms", "others at compile", "measured ms", "error", "within 25%",
                   "load"):
        table.add_column(header, justify="right")
    for name, example, layout in ACCURACY:
        start = time.perf_counter()
        options = CompileOptions(model=REPO / "examples" / example, **layout)
        plan, out = compile_to_directory(options, folder / name.replace(" ", "_"))
        seconds = time.perf_counter() - start
        measured = launches(out, plan.world_size, args.steps, args.launches)
        error = plan.predicted.step_s / statistics.median(measured) - 1
        table.add_row(name, f"{seconds:.1f}", f"{plan.predicted.step_s * 1e3:.1f}", f"{plan.predicted.background_load:g}",
                      _cell(measured), f"{error:+.1%}",
                      "yes" if abs(error) <= 0.25 else "no", _load())
        console.print(f"{name}: compiled in {seconds:.1f} s, predicted {plan.predicted.step_s * 1e3:.1f} ms, "
                      f"measured {_cell(measured)} ms; compute x{max(plan.predicted.compute_factor, default=1.0):.3f} "
                      f"({plan.predicted.compute_factor_from}); basis {plan.predicted.basis}")
    return table


def pinned(description: str, recompute: list[str], model: Path) -> CompileOptions:
    """The options that compile the finalist the search described as ``description``."""
    found = LAYOUT.match(description)
    if found is None:
        raise ValueError(f"cannot read the layout {description!r}")
    pp, tp, dp, microbatches, size, schedule, chunks, zero, dtype = found.groups()
    return CompileOptions(model=model, pp=int(pp), tp=int(tp), dp=int(dp), microbatches=int(microbatches),
                          micro_batch_size=int(size), schedule=schedule, chunks=int(chunks or 1),
                          zero=0 if zero is None else int(zero or 1),
                          dtype=dtype or "fp32", recompute=tuple(recompute))


def _layout(plan) -> str:
    return plan.provenance.search["ranked"][0]["layout"]


def search(args: argparse.Namespace, folder: Path, console: Console) -> Table:
    table = Table(title=f"searched plan against its finalists, pure data parallel and one process (step ms: median of "
                        f"{args.launches} launches of {args.steps} steps; range in brackets)")
    for header in ("search", "layout", "predicted ms", "ran in the search ms", "measured ms", "vs fastest", "load"):
        table.add_column(header, justify="right")
    for entry in args.searches.split(","):
        name, world = entry.split(":")
        world = int(world)
        model = REPO / "examples" / f"{name}.py"
        label = f"{name} --world-size {world} --global-batch-size {args.global_batch_size}"
        searched = CompileOptions(model=model, world_size=world, global_batch_size=args.global_batch_size)
        start = time.perf_counter()
        plan, _ = compile_to_directory(searched, folder / f"{name}{world}")
        console.print(f"{label}: compiled in {time.perf_counter() - start:.1f} s (the search "
                      f"{plan.provenance.search['seconds']:.1f} s, running its finalists "
                      f"{plan.provenance.search.get('run_seconds', 0.0):.1f} s)")
        start = time.perf_counter()  # what a user who compiles the same model again waits
        again, _ = compile_to_directory(searched, folder / f"{name}{world}-again")
        console.print(f"{label}: compiled again in {time.perf_counter() - start:.1f} s (finalists "
                      f"{'read back' if again.provenance.search.get('from_cache') else 'run again'}; "
                      f"the same plan: {'yes' if _layout(again) == _layout(plan) else 'no'})")
        ranked = plan.provenance.search["ranked"][:5]
        ran = [r.get("measured_step_s") for r in ranked] + [None, None]
        rivals = [(f"#{i + 1}" + (" (chosen)" if i == 0 else ""), pinned(r["layout"], r["recompute"], model))
                  for i, r in enumerate(ranked)]
        rivals += [(f"--dp {world}", CompileOptions(model=model, dp=world, global_batch_size=args.global_batch_size)),
                   ("one process", CompileOptions(model=model, global_batch_size=args.global_batch_size))]
        rows = []
        for i, (what, options) in enumerate(rivals):
            compiled, out = compile_to_directory(options, folder / f"{name}{world}-{i}")
            measured = launches(out, compiled.world_size, args.steps, args.launches)
            layout = f"pp{compiled.mesh['pp']} tp{compiled.mesh['tp']} dp{compiled.mesh['dp']} " \
                     f"{compiled.schedule.microbatches}x{compiled.schedule.micro_batch_size} {compiled.schedule.kind}" \
                     + (f" ZeRO-{compiled.zero}" if compiled.mesh["dp"] > 1 else "")
            rows.append((what, layout, compiled.predicted.step_s, ran[i], measured))
            console.print(f"{label} {what} {layout}: predicted {compiled.predicted.step_s * 1e3:.1f} ms, "
                          f"measured {_cell(measured)} ms")
        fastest = min(statistics.median(m) for *_, m in rows)
        for what, layout, predicted, search_ran, measured in rows:
            table.add_row(f"{label} {what}", layout, f"{predicted * 1e3:.1f}",
                          "-" if search_ran is None else f"{search_ran * 1e3:.1f}", _cell(measured),
                          f"{statistics.median(measured) / fastest - 1:+.1%}", _load())
        table.add_section()
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3, help="torchrun launches per row (default 3)")
    parser.add_argument("--steps", type=int, default=60, help="steps per launch (default 60)")
    parser.add_argument("--parts", default="accuracy,search", help="accuracy, search or both (default both)")
    parser.add_argument("--searches", default="gpt:2,llama:2,gpt:4,llama:4", help="example:world-size, comma-separated")
    parser.add_argument("--global-batch-size", type=int, default=16, help="of every search (default 16)")
    parser.add_argument("--cache", type=Path, help="keep the cache in this folder and reuse what it holds (default: a fresh one)")
    args = parser.parse_args(argv)
    console = Console(highlight=False, width=200)
    with tempfile.TemporaryDirectory(prefix="first_run_") as folder:
        folder = Path(folder)
        # a fresh cache: what a first compile measures
        os.environ["AUTOPART_CACHE_DIR"] = str(args.cache or folder / "cache")
        console.print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {_load()}, "
                      f"{os.cpu_count()} cores: python benchmarks/first_run.py {' '.join(argv or sys.argv[1:])}")
        parts = args.parts.split(",")
        if "accuracy" in parts:
            console.print(accuracy(args, folder, console))
        if "search" in parts:
            console.print(search(args, folder, console))
    return 0


if __name__ == "__main__":
    sys.exit(main())
