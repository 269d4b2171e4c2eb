"""train.py's flags (`parse_args`), checked together before any process waits for a peer, and what
they ask of a resume: each mistake one line (`autopart.ir.errors.ConfigError`), on every rank
alike, since every rank reads the same flags."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors import SafetensorError, safe_open

from autopart.ir.errors import ConfigError, OneLineParser
from autopart.ir.plan import Plan
from autopart.runtime.checkpoint import CheckpointContext, restarted
from autopart.runtime.launch import PLAN_HASH_KEY
from autopart.runtime.output_paths import MARKER, check_file_path, check_folder_path
from autopart.runtime.optim import OPTIMIZERS
from autopart.runtime.recipe import Recipe, add_recipe_arguments
from autopart.runtime.mesh import Mesh
from autopart.runtime.shards import weights_file_name
from autopart.runtime.stage import check_checkpoint, model_shapes, state_names, tensor_aliases

__all__ = ["parse_args", "DEFAULT_TIMEOUT_S", "timeout_to_refuse_with", "check_arguments", "note_optimizer_state", "check_compile_kept", "check_initial_weights", "check_weights_folder", "compile_files",
           "resumed", "resumed_past_the_end"]

DEFAULT_TIMEOUT_S = 600.0
LONGEST_TIMEOUT_S = 365 * 24 * 3600.0
"""A year: past it (inf, 1e20) the timeout does not fit the process group's, which failed in a traceback."""
SEED_LIMIT = 2**40
"""The synthetic batches seed a generator with seed * 1_000_003 + step, which must fit in 64 bits."""



def parse_args(argv: list[str] | None, plan: Plan) -> argparse.Namespace:
    parser = OneLineParser(prog="train.py", description="Train the compiled model (run under torchrun).")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--seconds", type=float,
                        help="stop before --steps once the steps took S seconds together, each timed on its slowest "
                        "rank so that every rank stops after the same step (for timing runs: the model file's batches "
                        "are drawn again where they run out)")
    parser.add_argument("--min-steps", type=int, help="with --seconds, at least N steps (default 1)")
    parser.add_argument("--untimed-steps", type=int,
                        help="with --seconds, the first N steps (a warm-up) do not count toward them (default 0)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=plan.optimizer)
    parser.add_argument("--seed", type=int, default=0, help="seed of the training batches and of what the model "
                        "draws (dropout), per step, replica, microbatch and stage (default 0)")
    parser.add_argument("--no-dropout", action="store_true",
                        help="every dropout passes its input through (autopart verify compares a model with dropout so)")
    parser.add_argument("--metrics", type=Path,
                        help="append one JSON line per step: step, loss, step_s, lr, peak_memory_bytes (per rank; and "
                        "peak_reserved_bytes on a GPU), "
                        "tokens_per_s, tflops_per_device, mfu, and grad_norm, eval_loss when asked for")
    parser.add_argument("--trace", type=Path, help="write the measured timeline of the last step (Chrome trace JSON)")
    parser.add_argument("--action-times", type=Path,
                        help="each rank writes DIR/rank_<r>.jsonl: per step, each action's wall and CPU seconds")
    parser.add_argument("--save-weights", type=Path, help="write each stage's final weights here (safetensors)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds before a stuck peer is an error")
    parser.add_argument(
        "--weights", type=Path, help="initial weights: a safetensors file of the model, read by parameter name"
    )
    parser.add_argument("--checkpoint-dir", type=Path, help="save checkpoints here (torch.distributed.checkpoint)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save every K steps (default: at the end only)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint in --checkpoint-dir")
    add_recipe_arguments(parser)
    parser.add_argument("--eval-every", type=int, default=0, help="every K steps, the mean loss on held-out batches")
    parser.add_argument("--eval-batches", type=int, default=1, help="held-out global batches per evaluation (default 1)")
    parser.add_argument("--tensorboard", type=Path, help="write scalars here (needs the tensorboard package)")
    return parser.parse_args(argv)

def timeout_to_refuse_with(timeout_s: float) -> float:
    """The seconds that every rank waits for the others' refusals: ``--timeout`` where it is one
    (0 or nan is itself what they refuse, and made the process group fail in a traceback first)."""
    return timeout_s if 0 < timeout_s <= LONGEST_TIMEOUT_S else DEFAULT_TIMEOUT_S


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse flags out of range (the training recipe's too), flags that need another, and output
    paths that cannot be written."""
    for flag, path in (("--metrics", args.metrics), ("--trace", args.trace)):
        check_file_path(path, flag)
        _check_ours(path, flag)
    for flag, path in (("--action-times", args.action_times), ("--save-weights", args.save_weights),
                       ("--checkpoint-dir", args.checkpoint_dir), ("--tensorboard", args.tensorboard)):
        check_folder_path(path, flag)
    for path in sorted(Path(args.action_times).glob("rank_*.jsonl")) if args.action_times else []:
        _check_ours(path, "--action-times")  # each rank appends to its own file there
    for flag, value, least in (("--steps", args.steps, 1), ("--min-steps", args.min_steps, 1),
                               ("--untimed-steps", args.untimed_steps, 0), ("--checkpoint-every", args.checkpoint_every, 0),
                               ("--eval-every", args.eval_every, 0), ("--eval-batches", args.eval_batches, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be at least {least}, got {value}")
    Recipe.from_args(args).check(lr=args.lr, optimizer=args.optimizer)
    if args.checkpoint_every and args.checkpoint_dir is None:
        raise ConfigError("--checkpoint-every saves into --checkpoint-dir DIR; give it too, or drop --checkpoint-every")
    if args.eval_batches != 1 and not args.eval_every:
        raise ConfigError("--eval-batches counts the held-out batches of each --eval-every K; give it too, or drop "
                          "--eval-batches")
    if not 0 < args.timeout <= LONGEST_TIMEOUT_S:
        raise ConfigError(f"--timeout must be a positive number of seconds, at most {LONGEST_TIMEOUT_S:.0f} (a year), "
                          f"got {args.timeout:g}")
    if not -SEED_LIMIT < args.seed < SEED_LIMIT:
        raise ConfigError(f"--seed must lie between -2**40 and 2**40 ({SEED_LIMIT}), got {args.seed}; give a smaller seed")
    if args.seconds is not None and not args.seconds >= 0:
        raise ConfigError(f"--seconds must be a number of seconds, at least 0, got {args.seconds:g}")
    if args.seconds is None and (args.min_steps is not None or args.untimed_steps is not None):
        raise ConfigError(f"{'--min-steps' if args.min_steps is not None else '--untimed-steps'} counts toward "
                          "--seconds S; give --seconds too, or drop it")
    if args.seconds is not None and args.trace:
        raise ConfigError("--trace records the last of --steps, which --seconds may not reach; give one of them")


def resumed(checkpointing: CheckpointContext, args: argparse.Namespace, rank: int) -> int:
    """The steps done by the checkpoint this run resumes from (0 where it starts afresh); where
    one is resumed, a --weights given beside it (for a launch that may find none) is not read."""
    done = checkpointing.resume() if args.checkpoint_dir and (args.resume or restarted()) else 0
    if done and args.weights is not None and rank == 0:
        print(f"autopart: note: resumed from a checkpoint, so --weights {args.weights} (a run's start) was not read",
              file=sys.stderr, flush=True)
    return done


def resumed_past_the_end(args: argparse.Namespace, done: int, *, restarted: bool) -> bool:
    """Whether a resumed run has nothing left to train (its checkpoint had done ``done`` of
    ``--steps``): True for torchrun's restart of a run whose last checkpoint ended it; a first
    launch with --resume is refused, as it would train nothing and write none of the outputs it
    was given."""
    if done < args.steps:
        return False
    if restarted:
        return True
    raise ConfigError(f"--steps {args.steps}: the checkpoint resumed from had done {done} steps already; give "
                      f"--steps above {done} to train on")


def check_weights_folder(folder: Path | None, plan: Plan, digest: str) -> None:
    """Refuse a --save-weights folder that holds stage files this plan does not write (another
    plan's: merged with this run's, they would mix another run's weights into this one's), or the
    files it writes but not as this plan's weights (``digest``, `plan_digest`, names the plan in
    each file that train.py saves): a file of the user's, or another compile's weights, would be
    replaced without a word. A rerun's own weights are replaced. Only the files' headers are read."""
    if folder is None or not folder.is_dir():
        return
    tp = plan.mesh["tp"]
    ours = sorted({weights_file_name(stage.index, r, tp) for stage in plan.stages for r in range(tp)})
    others = sorted(p.name for p in folder.glob("stage_*.safetensors") if p.name not in ours)
    if others:
        raise ConfigError(f"--save-weights {folder} holds {others[0]}, which this plan ({len(plan.stages)} stages, tp "
                          f"{tp}) does not write: another run's; give a new or empty folder")
    for name in (n for n in ours if (folder / n).exists() or (folder / n).is_symlink()):
        try:
            with safe_open(str(folder / name), framework="pt") as handle:
                written_with = (handle.metadata() or {}).get(PLAN_HASH_KEY)
        except (SafetensorError, OSError, ValueError):
            written_with = None
        if written_with is None:
            raise ConfigError(f"--save-weights {folder} holds {name}, which names no plan (not autopart's, or saved "
                              "by an older autopart); give another folder, or delete the file first")
        if written_with != digest:
            raise ConfigError(f"--save-weights {folder} holds {name}, another compile's weights (plan sha256 "
                              f"{written_with[:12]}, this one's {digest[:12]}); give another folder, or delete them first")


def compile_files(out_dir: Path, plan: Plan) -> set[Path]:
    """The files autopart compile wrote in ``out_dir``: those its marker lists, and those the ranks
    read (all there is of an output whose marker is gone or that an earlier autopart wrote)."""
    names = {"plan.json", "train.py", "model.py", MARKER, *plan.stage_sha256}
    try:
        names.update(name for name in json.loads((out_dir / MARKER).read_text())["files"] if isinstance(name, str))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    names.update(path.relative_to(out_dir).as_posix() for path in (out_dir / "weights").glob("*.safetensors"))
    return {(out_dir / name).resolve() for name in names}


def check_compile_kept(out_dir: Path, plan: Plan, args: argparse.Namespace) -> None:
    """Refuse an output of train.py's flags that would write over a file of the compile it runs:
    metrics appended to plan.json leave a compile that no longer starts, final weights saved into
    OUT/weights one whose next run starts from trained weights without a word."""
    kept = compile_files(out_dir, plan)
    written = [(flag, path, Path(path)) for flag, path in (("--metrics", args.metrics), ("--trace", args.trace))
               if path is not None]
    if args.save_weights is not None:
        tp = plan.mesh["tp"]
        written += [("--save-weights", args.save_weights, Path(args.save_weights) / weights_file_name(stage.index, r, tp))
                    for stage in plan.stages for r in range(tp)]
    for flag, given, path in written:
        if path.resolve() in kept:
            raise ConfigError(f"{flag} {given} would write over {path.resolve().relative_to(out_dir).as_posix()}, "
                              f"which autopart compile wrote in {out_dir}; give a path outside the compile's files")


_WRITTEN = {"--metrics": "JSON lines of steps", "--trace": "a Chrome trace", "--action-times": "JSON lines of steps"}


def _check_ours(path: Path | None, flag: str) -> None:
    """Refuse an existing file at ``path`` that train.py did not write there (--metrics and
    --action-times append to one, --trace replaces it): the user's own file (``--trace model.py``) is kept as it is."""
    if path is None or not Path(path).is_file():
        return
    with open(path, "rb") as file:
        first = file.readline(1 << 16).strip()
    if not first:
        return
    # by how train.py's lines begin: a step of a long schedule's --action-times, or of many ranks'
    # --metrics, is longer than what is read of it
    ours = first.startswith(b'{"traceEvents": [' if flag == "--trace" else b'{"step": ')
    if not ours:
        raise ConfigError(f"{flag} {path} exists and is not {_WRITTEN[flag]} that train.py wrote; give a new path, or "
                          "move the file away first")


def check_initial_weights(weights: Path | None, out_dir: Path, plan: Plan, rank: int) -> None:
    """Refuse a --weights checkpoint that lacks this rank's tensors before any peer waits."""
    if weights is None:
        return
    pipeline_rank = Mesh.of(plan).coordinates(rank).pp
    shapes, aliases = model_shapes(out_dir), tensor_aliases(out_dir)  # the model's, whichever stages this rank holds
    for stage_plan in plan.stages:
        if stage_plan.rank == pipeline_rank:
            check_checkpoint(weights, state_names(out_dir, stage_plan.index), stage_plan.index, shapes, aliases)


def note_optimizer_state(args: argparse.Namespace, plan: Plan, rank: int) -> None:
    """Say, on rank 0, where the optimizer keeps state that the plan's memory left out: a plan
    compiled for plain SGD (``--optimizer sgd``) counts none, so AdamW's two moments or SGD's
    momentum buffer, one fp32 tensor per parameter each, are beyond every figure it printed."""
    if rank != 0 or plan.optimizer != "sgd":
        return
    if args.optimizer == "adamw":
        kept, advice = "--optimizer adamw keeps two fp32 moments", "compile with --optimizer adamw to plan for them"
    elif args.momentum:
        kept, advice = "--momentum keeps an fp32 buffer", "a plan compiled with --optimizer adamw counts two"
    else:
        return
    print(f"autopart: note: {kept} per parameter that the plan, compiled for --optimizer sgd, does not count in its "
          f"memory; {advice}", file=sys.stderr)
