"""The ``autopart`` command line.

Every user mistake ends as one line on stderr, ``autopart: error: <what is wrong; what to do>``,
with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopart.errors import AutopartError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other user error
        print(f"autopart: error: {message}; see '{self.prog} --help'", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopart", description="A compiler for distributed training.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = commands.add_parser("compile", help="compile a model file into per-rank training programs")
    c.add_argument("model", type=Path, help="the model file (defines build_model and example_batch)")
    c.add_argument("-o", "--out", type=Path, required=True, help="output directory")
    c.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    batch = c.add_mutually_exclusive_group()
    batch.add_argument("--microbatches", type=int, help="microbatches per step")
    batch.add_argument("--micro-batch-size", type=int, help="samples per microbatch")
    c.add_argument("--global-batch-size", type=int, help="samples per step (default 8)")
    c.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved or zb-h1 (default 1f1b)")
    c.add_argument("--chunks", type=int, default=1, help="model chunks per rank, with --schedule interleaved")
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
    return parser


def _compile(args: argparse.Namespace, console: Console) -> None:
    from autopart.codegen.report import stage_table
    from autopart.compiler import CompileOptions, compile_to_directory

    options = CompileOptions(
        model=args.model,
        pp=args.pp,
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
        capture=args.capture,
        leaf=tuple(args.leaf),
    )
    plan, out = compile_to_directory(options, args.out)
    rows = stage_table(plan)
    table = Table(title=f"{args.model.name}: {plan.schedule.kind}, {plan.schedule.microbatches} microbatches")
    for header in rows[0]:
        table.add_column(header, justify="right")
    for row in rows[1:]:
        table.add_row(*row)
    console.print(table)
    console.print(
        f"predicted step {plan.predicted.step_s * 1e3:.3f} ms, bubble {plan.predicted.bubble:.1%}, "
        f"solver {plan.provenance.solver_status}, capture {plan.provenance.capture}"
    )
    console.print(f"compile peak memory {peak_memory_gib():.2f} GiB")
    console.print(f"wrote {out}/; train with:\n  torchrun --nproc-per-node {plan.world_size} {out}/train.py --steps 10")


class _Notes(logging.Handler):
    """Notes from the passes (a capture fallback) as ``autopart: note: ...`` lines on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"autopart: note: {record.getMessage()}", file=sys.stderr)


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
    console = Console(highlight=False)
    try:
        if args.command == "compile":
            _compile(args, console)
    except AutopartError as exc:
        print(f"autopart: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("autopart: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
