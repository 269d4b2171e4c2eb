"""The ``autopart`` command line.

Every user mistake ends as one line on stderr, ``autopart: error: <what is wrong; what to do>``,
with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import gc
import logging
import resource
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopart.predict.accuracy import describe_prediction, mfu_clause
from autopart.ir.errors import AutopartError, ConfigError, OneLineParser
from autopart.ir.plan import plan_files_read_once
from autopart.tools.local_run import LocalRunError
from autopart.runtime.process_exit import leave
from autopart.runtime.recipe import Recipe, add_recipe_arguments
from autopart.runtime.torchrun_command import plan_launch
from cost_models.calibration import usable_cores

__all__ = ["main", "run"]


def _add_layer_pins(c: argparse.ArgumentParser) -> None:
    """The pipeline cuts pinned by layer counts, in autopart's form and in Megatron's."""
    c.add_argument("--stage-layers", metavar="N,N,...",
                   help="pin the pipeline cuts: repeated layers per stage (pp x chunks counts, in model order; the "
                        "embedding goes with the first stage, the head with the last), e.g. 5,6,6,5")
    c.add_argument("--first-stage-layers", type=int, metavar="N",
                   help="Megatron's form of the pin (--decoder-first-pipeline-num-layers): N layers on the first "
                        "stage, the other stages an equal share of the rest")
    c.add_argument("--last-stage-layers", type=int, metavar="N",
                   help="N layers on the last stage (--decoder-last-pipeline-num-layers)")


def _add_measuring(c: argparse.ArgumentParser) -> None:
    """What the compile measures on this machine, and what it runs here."""
    c.add_argument("--profile-pipeline", action="store_true",
                   help="run the plan here for a few steps, store how much slower its stages compute inside the "
                        "pipeline in --costs, and compile again with it (once per model and mesh)")
    c.add_argument("--no-measure", action="store_true",
                   help="predict from the device's roofline: do not measure this machine's ops and messages "
                        "(by default measured once per model and machine, then cached)")
    c.add_argument("--run-finalists", action=argparse.BooleanOptionalAction, default=None,
                   help="run the search's finalists here a few seconds each and keep the fastest (default: where "
                        "the device is this machine's, measuring is on and every rank runs on it, their steps "
                        "kept per model and machine; given, they run afresh)")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="autopart", description="A compiler for distributed training.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    c = commands.add_parser("compile", help="compile a model file into per-rank training programs")
    c.add_argument("model", type=Path, help="the model file (defines build_model and example_batch)")
    c.add_argument("-o", "--out", type=Path, required=True, help="output directory")
    c.add_argument("--world-size", type=int,
                   help="devices to plan for: search every choice not pinned by the options below")
    c.add_argument("--pp", type=int, help="pipeline stages (default 1, or searched)")
    c.add_argument("--tp", type=int, help="tensor-parallel degree, innermost (default 1, or searched)")
    c.add_argument("--dp", type=int, help="data-parallel degree (default 1, or searched)")
    c.add_argument("--gpus-per-node", type=int, help="devices per node; larger groups cross nodes (default 8)")
    c.add_argument("--zero", type=int, nargs="?", const=1, default=None, choices=(0, 1, 2, 3),
                   help="shard over data-parallel ranks: 1 optimizer state (--zero alone), 2 and gradients, "
                        "3 and parameters (FSDP); default 0, or searched")
    c.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism with --tp: norms and residuals split over the sequence, reduce-scatter"
                        " and all-gather for TP's all-reduces (default on, or searched); --no-sp turns it off")
    c.add_argument("--tp-overlap", action="store_true",
                   help="overlap the sequence-parallel collectives with their linears, the sequence cut in pieces"
                        " (Megatron-LM's --tp-comm-overlap)")
    batch = c.add_mutually_exclusive_group()
    batch.add_argument("--microbatches", type=int, help="microbatches per step")
    batch.add_argument("--micro-batch-size", type=int, help="samples per microbatch")
    c.add_argument("--global-batch-size", type=int, help="samples per step (default 8)")
    c.add_argument("--schedule", help="gpipe, 1f1b, interleaved, zb-h1 or zbv (default 1f1b, or searched)")
    c.add_argument("--chunks", type=int, help="model chunks per rank, with --schedule interleaved (default 1, or searched; zbv: 2)")
    c.add_argument("--device", default="cpu", help="device spec to predict for (default: this machine's cpu)")
    c.add_argument("--memory", type=float, help="memory per device in GiB (default: the device's)")
    c.add_argument("--optimizer", default="adamw", help="sgd or adamw: its state counts in memory (default adamw)")
    c.add_argument("--plan", type=Path, help="emit this plan.json as it is instead of solving")
    c.add_argument("--time-limit", type=float, default=30.0, help="seconds per solver run (default 30)")
    c.add_argument(
        "--capture", choices=("fx", "export"), help="capture with torch.fx or torch.export (default: fx, export when fx fails)"
    )
    c.add_argument(
        "--leaf", action="append", default=[], metavar="CLASS", help="keep modules of this class whole (repeatable)"
    )
    c.add_argument("--costs", type=Path, help="cost database from 'autopart profile' (ops it lacks are timed into it)")
    c.add_argument(
        "--recompute", metavar="MODE",
        help="activation recompute: none, selective, full (layer by layer) or stage for every stage, or one per stage as A,B,... (default none, or searched)",
    )  # fmt: skip
    _add_layer_pins(c)
    c.add_argument("--dtype", help="fp32; bf16: bf16 working weights cast once per step from fp32 master weights, "
                                        "gradients accumulated in fp32 (Megatron-LM's mixed precision); bf16-autocast: "
                                        "fp32 weights cast by autocast in every forward; or auto (searched; default fp32)")
    _add_measuring(c)
    p = commands.add_parser("profile", help="time every op of a model on this machine into a cost database")
    p.add_argument("model", type=Path, help="the model file")
    p.add_argument("-o", "--out", type=Path, required=True, help="cost database (JSON); added to when it exists")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=[1], help="microbatch sizes to time (default 1)")
    p.add_argument("--optimizer", default="adamw", help="sgd or adamw: whose step to time (default adamw)")
    p.add_argument("--dtype", default="fp32", help="fp32, or bf16: forwards under the device's autocast, timed "
                                                   "under the keys a --dtype bf16 compile looks up (default fp32)")
    pc = commands.add_parser("profile-comm", help="measure p2p and collectives between processes on this machine")
    pc.add_argument("--ranks", type=int, default=2, help="processes to measure between (default 2)")
    pc.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    e = commands.add_parser("explain", help="show a compiled plan, and a measured step against its prediction")
    e.add_argument("out", type=Path, help="an output directory of autopart compile")
    e.add_argument("--trace", type=Path, help="a measured trace, from OUT/train.py --trace FILE")
    v = commands.add_parser("verify", help="run a compile's programs beside the original model and compare")
    v.add_argument("out", type=Path, help="the output directory of autopart compile")
    v.add_argument("--steps", type=int, default=3, help="training steps to compare (default 3)")
    v.add_argument("--lr", type=float, help="learning rate (default 0.1 for sgd, 1e-3 for adamw)")
    v.add_argument("--optimizer", default="sgd", help="sgd or adamw (default sgd: its updates are exact to compare)")
    v.add_argument("--timeout", type=float, default=600.0, help="seconds for the distributed run (default 600)")
    add_recipe_arguments(v)
    k = commands.add_parser("consolidate", help="merge a training checkpoint into the original model's state dict")
    k.add_argument("checkpoint", type=Path, help="a --checkpoint-dir (its latest good checkpoint) or one step_* in it")
    k.add_argument("-o", "--out", type=Path, required=True, help="the safetensors file to write")
    k.add_argument("--model", type=Path, help="the model file that was compiled (needed: the file that the "
                   "checkpoint's plan names is not imported, a checkpoint being data)")
    return parser


def _verify(args: argparse.Namespace, console: Console) -> int:
    from autopart.ir.errors import ConfigError
    from autopart.runtime.optim import OPTIMIZERS
    from autopart.tools.verify import verify

    if args.optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {args.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    try:
        result = verify(args.out, steps=args.steps, lr=args.lr, optimizer=args.optimizer, timeout_s=args.timeout,
                        recipe=Recipe.from_args(args))
    except LocalRunError as exc:
        print(f"autopart: verify: {exc}", file=sys.stderr)
        return 1
    if result.without_dropout:
        console.print("the model draws random numbers (dropout), which this plan draws per stage, microbatch and "
                      "rank where one process draws them once: both trained with dropout off", soft_wrap=True)
    if result.reference_parts != (1, 1):
        console.print("the model normalises by its batch (BatchNorm): the reference ran one forward per microbatch of "
                      "each replica, {} x {}, as the plan does".format(*result.reference_parts), soft_wrap=True)
    console.print(
        f"{result.steps} steps: largest loss difference {result.loss_difference:.3g} (step {result.loss_step}, "
        f"tolerance {result.loss_tolerance}); largest parameter difference {result.parameter_difference:.3g} "
        f"({result.parameter or 'none'}, tolerance {result.parameter_tolerance})",
        soft_wrap=True,
    )
    if result.matches:
        console.print(f"the distributed programs match the original model (losses within {result.loss_tolerance}; "
                      f"parameters within {result.parameter_tolerance})", soft_wrap=True)
        return 0
    for line in result.failures[:10]:
        print(f"autopart: verify: {line}", file=sys.stderr)
    if len(result.failures) > 10:
        print(f"autopart: verify: ... and {len(result.failures) - 10} more", file=sys.stderr)
    return 1


def _consolidate(args: argparse.Namespace, console: Console) -> None:
    from autopart.tools.consolidate import consolidate

    summary = consolidate(args.checkpoint, args.out, args.model)
    for line in summary.skipped:
        print(f"autopart: {line}", file=sys.stderr)
    if summary.unread:
        print(f"autopart: note: no stage reads {', '.join(summary.unread)}, so training left them as they started: "
              "they are written as build_model() makes them (a run started from --weights started them from there)",
              file=sys.stderr)
    console.print(f"wrote {args.out}: {summary.tensors} tensors from {summary.checkpoint} (after {summary.step} steps)")


def _profile(args: argparse.Namespace, console: Console) -> None:
    from autopart.ir.model_file import load_model_file
    from autopart.passes.capture import capture
    from autopart.ir.errors import ConfigError
    from autopart.runtime.output_paths import check_parent
    from autopart.profiling.profile import profile_costs
    from autopart.runtime.optim import OPTIMIZERS
    from cost_models import CostDatabase

    if args.optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {args.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if any(b < 1 for b in args.micro_batch_size):
        raise ConfigError(f"--micro-batch-size must be at least 1, got {min(args.micro_batch_size)}")
    if args.out.exists() and args.out.is_dir():
        raise ConfigError(f"{args.out} is a directory; give the path of a .json file with -o")
    check_parent(args.out, "-o")
    spec = load_model_file(args.model)
    graph = capture(spec)
    database = CostDatabase.load(args.out)
    known = len(database.entries)
    timed = 0
    for size in args.micro_batch_size:
        timed += profile_costs(graph, spec, database, device=args.device, micro_batch_size=size,
                               optimizer=args.optimizer, console=console, dtype=args.dtype)
    database.save(args.out)
    console.print(f"timed {timed} ops ({known} already in the database); wrote {args.out}")


def _profile_comm(args: argparse.Namespace, console: Console) -> None:
    from cost_models.comm_profile import profile_comm

    result, path = profile_comm(ranks=args.ranks, backend=args.backend)
    console.print(result.describe())
    console.print(f"wrote {path}; the '{result.device}' device spec now uses these figures")


_UNWRAPPED = 400
"""The console's columns where the output is not a terminal: more than any table of ours needs,
so none wraps a cell (a table takes its natural width, up to the console's)."""


def _console() -> Console:
    """The commands' console. Into a file or a pipe (a CI log, ``| tee``) a line stays whole, for
    grep, and a table its natural width: rich would wrap both at 80 columns."""
    console = Console(highlight=False, markup=False)  # paths and names as given: '-o runs/[exp]' is no style
    if not console.is_terminal:
        console.soft_wrap, console.width = True, _UNWRAPPED
    return console


def _print_table(console: Console, rows: list[list[str]], title: str, caption: str = "") -> None:
    table = Table(title=title, caption=caption or None, caption_justify="left")
    for header in rows[0]:
        table.add_column(header, justify="right")
    for row in rows[1:]:
        table.add_row(*row)
    console.print(table)


def _compile(args: argparse.Namespace, console: Console) -> None:
    from autopart.codegen.report import ESTIMATED_NOTE, collectives_line, search_table, stage_table
    from autopart.driver import CompileOptions, compile_to_directory
    from autopart.options import check_sequence_parallel_asked, local_kind
    from autopart.runtime.output_paths import check_file_path

    check_sequence_parallel_asked(sp=args.sp, tp_overlap=args.tp_overlap, tp=args.tp, world_size=args.world_size,
                                  plan=args.plan, pp=args.pp, dp=args.dp)
    options = CompileOptions(
        model=args.model,
        world_size=args.world_size, pp=args.pp, tp=args.tp, dp=args.dp,
        zero=args.zero,
        sp=args.sp,
        tp_overlap=args.tp_overlap,
        gpus_per_node=args.gpus_per_node,
        microbatches=args.microbatches,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        schedule=args.schedule,
        chunks=args.chunks,
        device=args.device,
        memory_gib=args.memory,
        optimizer=args.optimizer,
        plan=args.plan,
        time_limit_s=args.time_limit,
        costs=args.costs,
        capture=args.capture,
        leaf=tuple(args.leaf),
        recompute=_recompute_modes(args.recompute) if args.recompute is not None else None,
        dtype=args.dtype,
        stage_layers=_layer_counts(args.stage_layers) if args.stage_layers is not None else None,
        first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers,
        profile_pipeline=args.profile_pipeline,
        measure=not args.no_measure,
        run_finalists=args.run_finalists,
    )
    # timed ops are added to it where the device is this machine's; another device's is only read
    check_file_path(args.costs, "--costs", writes=local_kind(options.device) is not None)
    known = _entries(args.costs)
    if options.searched:
        with _SearchProgress(console) as progress:
            plan, out = compile_to_directory(options, args.out, progress=progress, console=console)
        _print_table(console, search_table(plan), _search_title(plan))
        if any(entry.get("estimated") for entry in plan.provenance.search.get("ranked", [])):
            console.print(ESTIMATED_NOTE)
    else:
        plan, out = compile_to_directory(options, args.out, console=console)
    title = f"{args.model.name}: {plan.schedule.kind}, {plan.schedule.microbatches} microbatches"
    _print_table(console, stage_table(plan), title, caption=collectives_line(plan))  # ZeRO-2/3's, beside it
    console.print(
        f"predicted step {plan.predicted.step_s * 1e3:.3f} ms{describe_prediction(plan)}{mfu_clause(plan)}, "
        f"bubble {plan.predicted.bubble:.1%}, solver {plan.provenance.solver_status}, capture {plan.provenance.capture}"
    )
    if args.costs is not None:
        console.print(f"costs from {args.costs}: {_entries(args.costs) - known} ops timed, {known} known")
    if plan.predicted.compute_factor_from != "none":
        where = {"pipeline": "measured in this pipeline", "device": "the device's, from profile-comm",
                 "co-run": "the model measured beside the host's other ranks"}
        factors = " ".join(f"x{f:.3f}" for f in plan.predicted.compute_factor)
        console.print(f"compute inside the pipeline, per stage: {factors} ({where[plan.predicted.compute_factor_from]})")
    search = plan.provenance.search
    ran = search["ranked"][0].get("measured_step_s") if search.get("chosen_by") == "run" else None
    finalists = "the fastest of the search's finalists run here"
    if search.get("from_cache"):
        finalists += f" at {_utc(search['ran_at'])}, read back; --run-finalists runs them again"
    for measured, how in ((plan.predicted.profiled_step_s, "the median step of the run that measured its pipeline"),
                          (ran, finalists)):
        if measured is not None:
            console.print(f"this plan ran here at {measured * 1e3:.3f} ms a step ({how}; "
                          f"predicted {(plan.predicted.step_s - measured) / measured:+.1%})")
    _print_turns(console, plan, ran)
    if (load := plan.predicted.background_load) > 0:  # beside a measured pipeline, those beyond its run's
        beyond = " more than beside its measured pipeline" if plan.predicted.compute_factor_from == "pipeline" else ""
        console.print(f"{load:g} other busy processes{beyond} shared this machine's cores while it compiled; the "
                      "predicted step counts them (compile on a quiet machine for a quiet one's step)")
    console.print(f"compile peak memory {peak_memory_gib():.2f} GiB")
    train = shlex.quote(f"{out}/train.py")  # a command to paste: a folder of spaces stays one word
    console.print(f"wrote {out}/; train with{plan_launch(plan, train, '--steps 10').block()}")


def _print_turns(console: Console, plan, ran: float | None) -> None:
    """Where a CPU plan's ranks outnumber the cores, that they take turns on them, and what the
    search found of one rank per core (`autopart.driver.with_fewer_ranks`)."""
    cores = usable_cores()
    if plan.provenance.cost_model.rpartition(":")[2] != "cpu" or plan.world_size <= cores:
        return
    turns = f"its {plan.world_size} ranks take turns on this machine's {cores} core{'s' * (cores > 1)}"
    fewer = plan.provenance.search.get("fewer_ranks")
    if not fewer or ran is None:
        hint = f" (--world-size {cores})" if plan.provenance.search else ""
        console.print(f"{turns} (the predicted step counts it): here, fewer ranks{hint} may train faster")
    elif "reason" in fewer:
        console.print(f"{turns} (the predicted step counts it); no plan of {fewer['world_size']} was found "
                      f"({fewer['reason']})")
    else:
        worst = fewer["error_worst"]  # None: no benchmark row ran that plan's layout, and the band says why
        band = f"no band: {fewer['error_benchmark']}" if worst is None else f"{fewer['error_benchmark']}: worst {worst:.0%}"
        best = (f"the best plan of {fewer['world_size']} ({fewer['layout']}) is predicted at "
                f"{fewer['predicted_step_s'] * 1e3:.1f} ms a step ({band}), this one ran at {ran * 1e3:.1f} ms")
        verdict = "not faster by more than that error" if worst is not None else "whether it is faster is not known"
        console.print(f"{turns}: {best}: --world-size {fewer['world_size']} trains faster here" if fewer["faster"]
                      else f"{turns} (the predicted step counts it); {best}, {verdict}")


class _SearchProgress:
    """A progress bar on stderr while the search captures the model and scores layouts."""

    def __init__(self, console: Console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        stderr = Console(stderr=True)  # where it is not a terminal, rich would leave an empty line behind
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=stderr, transient=True, disable=not stderr.is_terminal)
        self.task = None

    def __enter__(self) -> _SearchProgress:
        self.bar.start()
        self.task = self.bar.add_task("search", total=None)
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def __call__(self, what: str, done: int, total: int) -> None:
        self.bar.update(self.task, description=what, completed=done, total=total or None)


def _search_title(plan) -> str:
    found = plan.provenance.search
    ran = (f"read back from their run at {_utc(found['ran_at'])}" if found.get("from_cache")
           else f"{found.get('run_seconds', 0):.1f} s")
    chosen = f"the fastest of the finalists run here ({ran}) first" if found.get("chosen_by") == "run" else \
        "the chosen plan first"
    return (f"search: {found['layouts']} layouts, {found['scored']} scored, {found['fitting']} fit, "
            f"{found['seconds']:.1f} s; {chosen}")


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))


def _recompute_modes(text: str) -> str | tuple[str, ...]:
    """``--recompute full`` for every stage, or ``--recompute full,none`` for each stage in turn."""
    modes = [mode.strip() for mode in text.split(",")]
    return modes[0] if len(modes) == 1 else tuple(modes)


def _layer_counts(text: str) -> tuple[int, ...]:
    """``--stage-layers 5,6,6,5``: whole numbers, one per stage."""
    try:
        return tuple(int(count) for count in text.split(","))
    except ValueError:
        raise ConfigError(f"--stage-layers takes whole numbers separated by commas (e.g. 5,6,6,5), got {text!r}") from None


def _entries(path: Path | None) -> int:
    from cost_models import CostDatabase

    return len(CostDatabase.load(path).entries) if path is not None else 0


def _explain(args: argparse.Namespace, console: Console) -> None:
    from autopart.codegen.report import collectives_line, stage_table
    from autopart.tools.explain import compare, comparison_rows, load_output, refused_as_it_is, step_lines

    plan = load_output(args.out)
    if (refused := refused_as_it_is(args.out, plan)) is not None:
        print(f"autopart: warning: the figures below are the compile's; train.py would refuse this folder: {refused}",
              file=sys.stderr)
    comparison = compare(plan, args.trace) if args.trace is not None else None  # a bad trace fails before printing
    spec = plan.schedule
    name = Path(plan.provenance.model_file).name
    title = f"{name}: {spec.kind}, pp={plan.mesh['pp']}, {spec.microbatches} microbatches of {spec.micro_batch_size}"
    _print_table(console, stage_table(plan), title, caption=collectives_line(plan))  # ZeRO-2/3's, beside it
    predicted = plan.predicted
    console.print(
        f"predicted step {predicted.step_s * 1e3:.3f} ms{describe_prediction(plan)}{mfu_clause(plan)}, "
        f"bubble {predicted.bubble:.1%}, cost model {plan.provenance.cost_model}"
    )
    if comparison is None:
        measure = plan_launch(plan, shlex.quote(f"{args.out}/train.py"), "--steps 3 --trace trace.json")
        console.print(f"measure a step with: {measure.one_line()}")
        return
    _print_table(console, comparison_rows(comparison, plan), f"predicted vs measured ({args.trace})")
    for line in step_lines(comparison, plan):
        console.print(line)


class _Notes(logging.Handler):
    """Notes from the passes (a capture fallback) as ``autopart: note: ...`` lines on stderr, and
    warnings (a plan whose memory is tight) as ``autopart: warning: ...``."""

    def emit(self, record: logging.LogRecord) -> None:
        kind = "warning" if record.levelno >= logging.WARNING else "note"
        print(f"autopart: {kind}: {record.getMessage()}", file=sys.stderr)


def _show_notes() -> None:
    logger = logging.getLogger("autopart")
    if not any(isinstance(h, _Notes) for h in logger.handlers):
        logger.addHandler(_Notes())
    logger.setLevel(logging.INFO)


def peak_memory_gib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 30) if sys.platform == "darwin" else peak / (1 << 20)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    _show_notes()
    console = _console()
    try:
        if args.command == "compile":
            with plan_files_read_once():
                _compile(args, console)
        elif args.command == "profile":
            _profile(args, console)
        elif args.command == "profile-comm":
            _profile_comm(args, console)
        elif args.command == "explain":
            _explain(args, console)
        elif args.command == "verify":
            raise SystemExit(_verify(args, console))
        elif args.command == "consolidate":
            _consolidate(args, console)
    except AutopartError as exc:
        print(f"autopart: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except LocalRunError as exc:  # the programs ran and failed: not the input's fault
        print(f"autopart: {args.command}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("autopart: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def run() -> None:
    """The ``autopart`` command: `main`, then, where it ends well, the process short of the
    interpreter's teardown (`autopart.runtime.process_exit.leave`): its files are written and
    closed, and freeing a large compile's objects one by one took seconds after its last line.
    ``autopart compile`` keeps the cycle collector off to its end: the compile turns it off while
    it runs (`autopart.driver.cycle_collector_off`), and on again it would walk, at its first
    pass, every object the compile left alive (a large plan's schedules, kept for the report)
    just before the process ends. The other commands keep it: ``verify`` trains in this process."""
    if sys.argv[1:2] == ["compile"]:
        gc.disable()
    main()
    leave()


if __name__ == "__main__":
    run()
