"""What a compile is asked to do: one options value, shared by the command line and the Python API.

Validated on construction, so that every bad combination fails in one line before any pass runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
import operator
import os
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any

import torch

from autopart.ir.divisors import divisors
from autopart.ir.errors import AutopartError, ConfigError
from autopart.ir.tensors import DTYPES
from autopart.passes.recompute import stage_modes
from autopart.runtime.optim import OPTIMIZERS
from autopart.runtime.fully_sharded import check_level
from autopart.schedule import MOST_MICROBATCHES, SCHEDULE_KINDS, SPLIT_BACKWARD_KINDS
from cost_models.comm import NodeSpan, node_span
from cost_models.devices import local_device_name

__all__ = ["CompileOptions", "check_option_names", "check_sequence_parallel_asked", "local_kind"]

MOST_DEVICES = 1 << 20
"""More devices, and stages, than any cluster holds: layouts are enumerated and stages listed one by
one, and --pp 10**9 ran out of memory (10**20: an OverflowError) where one line would do."""
MOST_MEMORY_GIB = float(1 << 30)
"""An exbibyte per device: past it (1e300) the bytes overflowed an integer, in a traceback."""


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """Everything ``autopart compile`` takes; shared by the command line and the Python API."""

    model: Path
    """The model file (see the model-file contract)."""
    world_size: int | None = None
    """Devices to plan for. With it, every option left as None below is searched (see
    ``autopart.solve.search``); without it, they take their defaults (one device, 1F1B, ...)."""
    pp: int | None = None
    """Pipeline stages (one rank each); 1 unless searched."""
    tp: int | None = None
    """Tensor-parallel degree: ranks that split each op of a stage (innermost, inside a node); 1 unless searched."""
    dp: int | None = None
    """Data-parallel degree: copies of the whole pipeline, each on its share of the batch; 1 unless searched."""
    zero: int | bool | None = None
    """What to shard over the data-parallel group: 1 the optimizer state (ZeRO-1), 2 the gradients
    too, 3 the parameters too (2 and 3 through FSDP); 0 (or False) nothing; True means 1; 0 unless searched."""
    sp: bool | None = None
    """Sequence parallelism with TP (``autopart.solve.sequence``); on unless searched, a no-op at tp 1."""
    tp_overlap: bool = False
    """Overlap the sequence-parallel collectives with the linears beside them, the sequence cut into pieces
    (``autopart.runtime.overlapped``, Megatron-LM's ``--tp-comm-overlap``); needs sequence parallelism."""
    gpus_per_node: int | None = None
    """Devices per node: collectives of groups larger than this cross nodes (8 where neither the
    caller nor the plan of ``--plan`` says; always an int once the options are made)."""
    microbatches: int | None = None
    """Microbatches per step; by default twice the stages, or global batch / micro-batch size."""
    micro_batch_size: int | None = None
    """Samples per microbatch; the other way to fix the microbatch count."""
    global_batch_size: int | None = None
    """Samples per training step; by default microbatches x micro-batch size, or 8."""
    schedule: str | None = None
    """Pipeline schedule: gpipe, 1f1b, interleaved, zb-h1 or zbv; 1f1b unless searched."""
    chunks: int | None = None
    """Model chunks per rank (interleaved schedule); 1 unless searched."""
    device: str = "cpu"
    """Device spec that costs and memory are predicted for (``cpu`` is calibrated on the machine at hand)."""
    memory_gib: float | None = None
    """Memory per device in GiB; by default the device spec's."""
    optimizer: str = "adamw"
    """Optimizer whose state the memory model counts, and the runtime's default."""
    plan: Path | None = None
    """A plan.json to emit as it is, skipping the solver."""
    time_limit_s: float = 30.0
    """Time limit of each CP-SAT solve."""
    costs: Path | None = None
    """A cost database (``autopart profile``): measured op times replace the roofline's where
    known. When the device is the one at hand, ops it lacks are timed and added to it."""
    capture: str | None = None
    """How to capture the model: "fx" or "export"; by default fx, and export when fx fails."""
    leaf: tuple[str, ...] = ()
    """Module classes kept whole by tracing (``call_module`` nodes); each stage builds its own."""
    recompute: str | tuple[str, ...] | None = None
    """Activation recompute: "none", "selective", "full" or "stage" for every stage, or one per stage
    (``autopart.passes.recompute``); none unless searched (then chosen per stage)."""
    dtype: str | None = None
    """Precision (`autopart.ir.tensors.DTYPES`): "fp32"; "bf16", mixed precision as Megatron-LM
    runs it (bf16 working weights cast once per step, fp32 master weights, optimizer state and
    gradient accumulation); "bf16-autocast" (fp32 weights cast by torch.autocast in every
    forward); "auto" lets the search choose between fp32 and bf16; fp32 unless searched."""
    profile_pipeline: bool = False
    """Run the compiled programs here for a few steps, store how much longer their stages
    compute inside the running pipeline than alone in ``costs`` (`autopart.profiling.pipeline`),
    and compile again with it. Once per model and mesh: a later compile finds it there."""
    stage_layers: tuple[int, ...] | None = None
    """Pin the pipeline cuts: the number of repeated layers on each stage (pp x chunks of them,
    in model order), the embedding with the first and the head with the last
    (``autopart.solve.stage_layers``); by default the cut solver chooses them."""
    first_stage_layers: int | None = None
    """Megatron-LM's form of the pin (``--decoder-first-pipeline-num-layers``): the first stage's
    layer count, the others split the rest equally; with ``last_stage_layers`` or alone."""
    last_stage_layers: int | None = None
    """The last stage's layer count (``--decoder-last-pipeline-num-layers``)."""
    measure: bool = True
    """Without ``costs``, on the machine at hand: measure its ops and messages first, once per
    model and machine (`autopart.profiling.measure_defaults`); False keeps the device's roofline."""
    run_finalists: bool | None = None
    """A search's finalists run here for a few seconds each and the fastest is kept
    (`autopart.profiling.finalists`); by default where the device is this machine's, measuring is
    on and every rank runs on this host, their steps read back from the cache where an earlier
    compile ran the same plans; True insists, and runs them afresh (refused where they cannot run
    here)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # a Python caller's '2' for pp, or 'Block' for leaf
            value = getattr(self, field.name)
            converted = _as_annotated(field.name, value, _ANNOTATIONS[field.name])
            if converted is not value:
                object.__setattr__(self, field.name, converted)
        self._check_device_counts()
        if self.schedule == "zbv" and self.chunks is None:  # its V is two chunks per rank
            object.__setattr__(self, "chunks", 2)
        if self.plan is not None and not self.pins_layers:  # with layer pins: refused below, the file unread
            self._take_pins_from_plan()
        if self.gpus_per_node is None:
            object.__setattr__(self, "gpus_per_node", 8)
        if self.world_size is None:  # nothing is searched: what is not given takes its default
            for name, default in _DEFAULTS.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
        if isinstance(self.zero, bool):
            object.__setattr__(self, "zero", int(self.zero))
        if self.zero not in (None, 0, 1, 2, 3):
            raise ConfigError(f"--zero must be 1, 2 or 3 (what is sharded over data-parallel ranks), got {self.zero}")
        if self.zero and self.dp == 1:
            raise ConfigError(f"--zero {self.zero} shards over data-parallel ranks; it needs --dp 2 or more")
        refused = check_level(self.zero or 0, dp=self.dp or 2, split_backward=self.schedule in SPLIT_BACKWARD_KINDS)
        if refused:  # what the runtime refuses of a plan, refused before compiling one
            raise ConfigError(refused)
        if self.tp_overlap and self.sp is False:
            raise ConfigError("--tp-overlap overlaps the sequence-parallel collectives: it needs sequence parallelism"
                              " (drop --no-sp)")
        if self.schedule is not None and self.schedule not in SCHEDULE_KINDS:
            raise ConfigError(f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULE_KINDS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        for name in ("chunks", "microbatches", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:  # interleaved's chunks: 2 or more (`autopart.schedule.generators`)
                least = 2 if name == "chunks" and self.schedule == "interleaved" else 1
                raise ConfigError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
        if self.chunks is not None and self.chunks > 1 and self.schedule not in (None, "interleaved", "zbv"):
            raise ConfigError(f"--chunks {self.chunks} needs --schedule interleaved (other schedules use 1 chunk)")
        if self.schedule == "zbv" and self.chunks != 2:
            raise ConfigError(f"--schedule zbv runs exactly 2 model chunks per rank in a V; drop --chunks {self.chunks}")
        if self.capture not in (None, "fx", "export"):
            raise ConfigError(f"unknown capture method {self.capture!r}; use --capture fx or --capture export")
        if self.leaf and self.capture == "export":
            raise ConfigError("--leaf keeps modules opaque to torch.fx, which torch.export cannot do; drop --capture export")
        if not self.time_limit_s > 0:  # CP-SAT would stop at once and hand back no cuts, or the first it met
            raise ConfigError(f"--time-limit must be a positive number of seconds, got {self.time_limit_s:g}")
        if self.memory_gib is not None and not 0 < self.memory_gib <= MOST_MEMORY_GIB:  # nan fails both comparisons
            raise ConfigError(f"--memory must be a positive number of GiB, at most {MOST_MEMORY_GIB:.0f}, got "
                              f"{self.memory_gib}")
        if self.dtype not in (None, *DTYPES, "auto"):
            raise ConfigError(f"unknown --dtype {self.dtype!r}; use one of {', '.join(DTYPES)} or auto")
        if self.dtype == "auto" and self.world_size is None:
            raise ConfigError("--dtype auto lets the search choose the precision; add --world-size N to search")
        if self.profile_pipeline and self.costs is None:
            raise ConfigError("--profile-pipeline keeps what it measures in a cost database: add --costs COSTS.json")
        if self.profile_pipeline and local_kind(self.device) != "cpu":
            raise ConfigError(f"--profile-pipeline runs the plan on this machine's CPU, so it profiles plans for "
                              f"--device cpu, not {self.device}")
        if self.run_finalists and self.world_size is None:
            raise ConfigError("--run-finalists runs a search's finalists: add --world-size N to search")
        if self.run_finalists and self.plan is not None:
            raise ConfigError("--run-finalists runs a search's finalists, and --plan pins the plan; drop one of them")
        if self.pins_layers:
            self._check_stage_layers()
        if self.recompute is not None:
            if self.pp is not None and self.chunks is not None:
                stage_modes(self.recompute, self.pp * self.chunks)
            elif not isinstance(self.recompute, str):
                raise ConfigError("--recompute with one mode per stage needs the stages pinned: add --pp (and --chunks)")
            else:
                stage_modes(self.recompute, 1)

    def _check_device_counts(self) -> None:
        for name in ("world_size", "pp", "tp", "dp", "gpus_per_node"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        for name in ("world_size", "pp", "tp", "dp", "gpus_per_node", "chunks"):
            value = getattr(self, name)
            if value is not None and value > MOST_DEVICES:
                raise ConfigError(f"--{name.replace('_', '-')} {value} is more than any cluster holds; give at most "
                                  f"{MOST_DEVICES}")
        if self.pp is not None and self.chunks is not None and self.pp * self.chunks > MOST_DEVICES:
            raise ConfigError(f"--pp x --chunks is {self.pp * self.chunks} stages, more than any cluster holds; give "
                              f"at most {MOST_DEVICES}")

    def _take_pins_from_plan(self) -> None:
        """Refuse a pin that the plan of ``--plan`` contradicts: the plan is emitted as it is, and
        the pin would be dropped without a word (``--pp 4`` giving a plan of 2 stages). What is not
        pinned is the plan's, not the defaults: a copy of these options (`dataclasses.replace`)
        pins them all, and must agree with the plan as well."""
        from autopart.ir.plan import load_plan

        plan = load_plan(Path(self.plan))
        for name, recorded in (("world_size", plan.world_size), ("pp", plan.mesh["pp"]), ("tp", plan.mesh["tp"]),
                               ("dp", plan.mesh["dp"]), ("schedule", plan.schedule.kind),
                               ("chunks", plan.schedule.chunks), ("microbatches", plan.schedule.microbatches),
                               ("micro_batch_size", plan.schedule.micro_batch_size),
                               ("global_batch_size", plan.schedule.global_batch_size), ("zero", plan.zero),
                               ("dtype", plan.dtype), ("gpus_per_node", plan.gpus_per_node)):
            given = getattr(self, name)
            if given is not None and given != "auto" and recorded is not None and given != recorded:
                flag = f"--{name.replace('_', '-')}"
                raise ConfigError(f"{flag} {given} contradicts {Path(self.plan).name}, which --plan emits as it is "
                                  f"({name} {recorded}); drop {flag}, or recompile without --plan")
            if given is None and name not in ("world_size", "micro_batch_size"):  # those two would search, or split
                object.__setattr__(self, name, recorded)
        modes = tuple(stage.recompute for stage in plan.stages)
        given_modes = (self.recompute,) * len(modes) if isinstance(self.recompute, str) else self.recompute
        for flag, contradicts, recorded in (
            # at tp 1 sequence parallelism is nothing either way (a copy of these options has sp on by default)
            ("--sp", self.sp is True and not plan.sp and plan.mesh["tp"] > 1, "sp False"),
            ("--no-sp", self.sp is False and plan.sp, "sp True"),
            ("--tp-overlap", self.tp_overlap and not plan.tp_overlap and plan.mesh["tp"] > 1, "tp_overlap False"),
            (f"--recompute {self.recompute if isinstance(self.recompute, str) else ','.join(self.recompute or ())}",
             given_modes is not None and tuple(given_modes) != modes, f"recompute {','.join(modes)}"),
        ):
            if contradicts:
                raise ConfigError(f"{flag} contradicts {Path(self.plan).name}, which --plan emits as it is ({recorded}); "
                                  f"drop {flag.split()[0]}, or recompile without --plan")
        for name, recorded in (("sp", plan.sp), ("tp_overlap", plan.tp_overlap), ("recompute", modes)):
            object.__setattr__(self, name, recorded)  # the plan's, for the copies of these options too

    @property
    def pins_layers(self) -> bool:
        """The cuts are pinned by layer counts (``--stage-layers`` or Megatron's first/last form)."""
        return self.stage_layers is not None or self.first_stage_layers is not None or self.last_stage_layers is not None

    def _check_stage_layers(self) -> None:
        flag = "--stage-layers" if self.stage_layers is not None else "--first-stage-layers/--last-stage-layers"
        if self.plan is not None:
            raise ConfigError(f"{flag} pins the cuts that --plan already records; drop one of them")
        if self.world_size is not None:
            raise ConfigError(f"{flag} pins the cuts of a layout given in full; drop --world-size and give "
                              "--pp (and --tp, --dp, --chunks)")
        stages = self.pp * self.chunks
        if self.stage_layers is None:
            given = [n for n in (self.first_stage_layers, self.last_stage_layers) if n is not None]
            if stages < 2:
                raise ConfigError(f"{flag} sets the first or last pipeline stage apart, and there is one stage; "
                                  "add --pp 2 or more")
            if min(given) < 1:
                raise ConfigError(f"{flag} gives a stage {min(given)} layers; every stage needs at least one")
            return
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            raise ConfigError("--stage-layers gives every stage's count; drop --first-stage-layers/--last-stage-layers")
        counts = tuple(self.stage_layers)
        if len(counts) != stages:
            raise ConfigError(f"--stage-layers lists {len(counts)} stages but --pp x --chunks is {stages}; "
                              "give one layer count per stage, in model order")
        for s, count in enumerate(counts):
            if count < 1:
                raise ConfigError(f"--stage-layers gives stage {s} {count} layers; every stage needs at least one")
        object.__setattr__(self, "stage_layers", counts)

    @property
    def searched(self) -> bool:
        """Some choice is left to the search (``world_size`` given, the plan not pinned)."""
        return self.world_size is not None and self.plan is None

    @property
    def ranks(self) -> int:
        """All the ranks: the world size searched, else the mesh given."""
        return self.world_size if self.world_size is not None else self.pp * self.tp * self.dp

    @property
    def ranks_per_host(self) -> int:
        """Ranks that run on one host (node) at once: all of them up to ``gpus_per_node``."""
        return min(self.ranks, self.gpus_per_node)

    @property
    def data_parallel_span(self) -> NodeSpan:
        """How a data-parallel group lies on the nodes (replicas are outermost, a replica's ranks apart)."""
        return node_span(self.dp, self.pp * self.tp, self.gpus_per_node, self.dp * self.pp * self.tp)

    @property
    def tensor_parallel_span(self) -> NodeSpan:
        """How a tensor-parallel group lies on the nodes (its ranks are neighbours)."""
        return node_span(self.tp, 1, self.gpus_per_node, self.ranks)

    @property
    def pipeline_crosses_nodes(self) -> bool:
        """The ranks of one pipeline (and so the transfers between its stages) span several nodes."""
        return self.pp * self.tp > self.gpus_per_node

    def batch_shape(self) -> tuple[int, int, int]:
        """(global batch, microbatches, micro-batch size), filled in and checked. With data
        parallelism every replica runs the microbatches on its share of the global batch."""
        m, b, total = self.microbatches, self.micro_batch_size, self.global_batch_size
        if total is None:
            total = m * b * self.dp if m is not None and b is not None else 8
        if total % self.dp:
            raise ConfigError(
                f"the global batch ({total}) does not split into {self.dp} equal data-parallel shares; "
                f"use a global batch that is a multiple of {self.dp}"
            )
        share = total // self.dp  # what one pipeline replica runs per step
        runnable = [d for d in divisors(share) if self._schedule_runs(d)]
        if m is None and b is None:  # up to two per stage, as many as divide the share and the schedule runs
            m = max((d for d in runnable if d <= 2 * self.pp), default=min(runnable, default=1))
        if m is None:
            m = share // b if share % b == 0 else 0
        if b is None:
            b = share // m if share % m == 0 else 0
        if m * b != share:
            share_text = f"{total}, {share} per data-parallel replica" if self.dp > 1 else f"{total}"
            raise ConfigError(
                f"the global batch ({share_text}) is not a whole number of microbatches; choose --global-batch-size,"
                " --microbatches and --micro-batch-size so that microbatches x micro-batch size x data-parallel"
                " degree = global batch"
            )
        if m > MOST_MICROBATCHES:
            raise ConfigError(f"{m} microbatches a step per data-parallel replica is more than the {MOST_MICROBATCHES} a "
                              f"schedule is laid out for; give a --micro-batch-size of at least "
                              f"{next(d for d in divisors(share) if share // d <= MOST_MICROBATCHES)}")
        if not self._schedule_runs(m):
            need = (f"interleaved needs microbatches ({m}) to be a multiple of the pipeline degree ({self.pp})"
                    if self.schedule == "interleaved" else
                    f"zbv needs at least 2 x pp - 1 = {2 * self.pp - 1} microbatches to fill its V (got {m})")
            if self.global_batch_size is None:  # the batch follows the counts: the nearest count that runs
                nearest = min((c for c in (m - m % self.pp, m - m % self.pp + self.pp, 2 * self.pp - 1)
                               if c >= 1 and self._schedule_runs(c)), key=lambda c: (abs(c - m), c))
                fix = f"use --microbatches {nearest}"
            elif runnable:  # the nearest count that also divides each replica's share of the batch
                nearest = min(runnable, key=lambda d: (abs(d - m), d))
                fix = f"use --microbatches {nearest}"
                fix += " (and drop --micro-batch-size)" if self.micro_batch_size else ""
            else:
                fix = f"use a --global-batch-size whose share per data-parallel replica ({share} now) has such a count"
            raise ConfigError(f"{need}; {fix}")
        return total, m, b

    def _schedule_runs(self, microbatches: int) -> bool:
        """Whether the pinned schedule runs this many microbatches: interleaved's rounds take one per
        stage, zbv's V needs 2 x pp - 1 to fill."""
        if self.schedule == "interleaved":
            return microbatches % self.pp == 0
        if self.schedule == "zbv":
            return microbatches >= 2 * self.pp - 1
        return True


_ANNOTATIONS = typing.get_type_hints(CompileOptions)
_REFUSED = object()


def _as_annotated(name: str, value: Any, annotation: Any) -> Any:
    """``value`` as its field's ``annotation`` says, or a ConfigError: the command line's parser
    gives every option its type, a Python caller may not. What means the same is converted: a
    str or os.PathLike for a path, a whole number for a float, a list for a tuple, and a str for a
    tuple as the command line reads it (``leaf="Block"`` one class, ``stage_layers="2,2"``). A bool
    is no whole number (``pp=True``), nor a float or a str one (``pp=2.0``, ``pp="2"``)."""
    members = typing.get_args(annotation) if isinstance(annotation, UnionType) else (annotation,)
    if value is None and type(None) in members:
        return None
    kinds = tuple(kind for kind in members if kind is not type(None))
    if isinstance(value, str) and "," in value and tuple[str, ...] in kinds:  # recompute="full,none", per stage
        return tuple(part.strip() for part in value.split(","))  # "full, none" as the command line takes it
    for kind in kinds:
        converted = _converted(kind, value)
        if converted is not _REFUSED:
            return converted
    wanted = " or ".join(_WANTED[kind] for kind in kinds)
    raise ConfigError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__}){_suggestion(name, value, kinds)}")


def _converted(kind: Any, value: Any) -> Any:
    """``value`` as a ``kind``, or ``_REFUSED``."""
    if kind is str and isinstance(value, os.PathLike):  # device=Path("gpu.toml"), as the command line takes it
        return os.fspath(value)
    if kind is bool or kind is str:
        return value if isinstance(value, kind) else _REFUSED
    if kind is int:
        try:  # a numpy integer is one; a float is not, even 2.0
            return _REFUSED if isinstance(value, bool) else operator.index(value)
        except TypeError:
            return _REFUSED
    if kind is float:
        return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else _REFUSED
    if kind is Path:
        return Path(value) if isinstance(value, (str, os.PathLike)) else _REFUSED
    assert typing.get_origin(kind) is tuple, f"no conversion to {kind} for an option"
    item = typing.get_args(kind)[0]
    if isinstance(value, str) and item is str:
        return (value,)
    if isinstance(value, str):  # whole numbers separated by commas, as --stage-layers takes them
        try:
            return tuple(int(part) for part in value.split(","))
        except ValueError:
            return _REFUSED
    if not isinstance(value, (list, tuple)):
        return _REFUSED
    items = tuple(_converted(item, v) for v in value)
    return _REFUSED if any(v is _REFUSED for v in items) else items


_WANTED = {int: "a whole number", bool: "True or False", float: "a number", str: "a str",
           Path: "a path (a str or pathlib.Path)", tuple[str, ...]: "a tuple of str (or one str)",
           tuple[int, ...]: "a tuple of whole numbers (or a str of them separated by commas, '2,2')"}


def _suggestion(name: str, value: Any, kinds: tuple[Any, ...]) -> str:
    """'; pass pp=2' where ``value`` is plainly a number of another type ('2', 2.0), else ''."""
    for kind in (int, float):
        if kind in kinds and isinstance(value, str | float):
            try:
                number = kind(value)
                if number == float(value):
                    return f"; pass {name}={number!r}"
            except (ValueError, OverflowError):  # int('x'), int(inf)
                continue
    return ""


_DEFAULTS = {"pp": 1, "tp": 1, "dp": 1, "zero": 0, "sp": True, "schedule": "1f1b", "chunks": 1, "recompute": "none",
             "dtype": "fp32"}
"""What the options not given are when nothing is searched."""


def check_option_names(names: Iterable[str], *, where: str = "autopart.compile") -> None:
    """Refuse a keyword of ``autopart.compile`` (or ``where``) that is no field of `CompileOptions`
    in one line, with the nearest field's name, where the dataclass would raise a TypeError."""
    fields = [field.name for field in dataclasses.fields(CompileOptions) if field.name != "model"]
    for name in names:
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"did you mean {close[0]}?" if close else f"the options are {', '.join(fields)}"
            raise ConfigError(f"{where} has no option {name!r}; {hint}")


def _checked_init(generated: Any) -> Any:
    """`CompileOptions.__init__` that refuses a misspelt keyword as `autopart.compile` does."""

    @functools.wraps(generated)
    def init(self: CompileOptions, *args: Any, **kwargs: Any) -> None:
        check_option_names((name for name in kwargs if name != "model"), where="CompileOptions")
        generated(self, *args, **kwargs)

    return init


CompileOptions.__init__ = _checked_init(CompileOptions.__init__)  # type: ignore[method-assign]


def check_sequence_parallel_asked(*, sp: bool | None, tp_overlap: bool, tp: int | None, world_size: int | None,
                                  plan: Any = None, pp: int | None = None, dp: int | None = None) -> None:
    """Refuse ``--sp`` or ``--tp-overlap`` as the user gave them where tensor parallelism is 1
    (pinned, left by the pinned pp and dp, or its default when nothing is searched): the plan would
    have neither, without a word. Checked on the user's own values, since `CompileOptions` fills
    ``sp`` in by default and the search pins it on for each of its layouts, TP 1 among them (a
    search given either takes only layouts with TP, `SearchSpace.least_tp`)."""
    left_one = world_size is not None and world_size <= (pp or 1) * (dp or 1)  # tp = world / (pp x dp)
    if plan is not None and tp is None:  # --plan emits its plan's tp
        from autopart.ir.plan import load_plan

        try:
            tp = load_plan(Path(plan)).mesh["tp"]
        except AutopartError:
            pass  # refused where the plan is read, in the words of that
    no_tensor_parallelism = tp == 1 or (tp is None and (left_one or (world_size is None and plan is None)))
    for flag, given in (("--sp", sp is True), ("--tp-overlap", tp_overlap)):
        if given and no_tensor_parallelism:
            raise ConfigError(f"{flag} splits what tensor parallelism computes, and this compile has none (tensor "
                              f"parallelism 1); add --tp 2 or more, or drop {flag}")


def local_kind(device: str) -> str | None:
    """``"cpu"`` or ``"cuda"`` when ``device`` is the machine at hand (so it can be timed), else None."""
    if device == local_device_name("cpu"):
        return "cpu"
    if torch.cuda.is_available() and device == local_device_name("cuda"):
        return "cuda"
    return None
