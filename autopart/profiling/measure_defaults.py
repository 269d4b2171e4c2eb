"""What the default compile measures on the machine at hand, once, before it predicts anything.

A step predicted from the device's roofline and default message figures is several times too
short on a CPU: ops timed alone run hot in the caches, and a gloo message costs both ranks CPU
time that no formula knows (docs/cost_accuracy.md). So when the compile's device is this
machine (``--device cpu``, or a GPU here) and the user gave no cost database, the compile
measures what the step model needs:

1. the message figures (``cost_models.comm_profile``, its `QUICK` effort) when the cache has
   none for this host, backend and torch; ``autopart profile-comm`` measures them at full effort
   (after the ops of 2., whose capture refuses a model that cannot be compiled before seconds of
   two processes are spent for it; a search's model, or a plan file's, is captured for that alone);
2. every op of the training graph in place (`autopart.profiling.profile.profile_costs`) into a cost
   database cached per machine and model hash (``$AUTOPART_CACHE_DIR/costs/``); its keys name
   shapes and dtypes, so other micro-batch sizes and precisions add to the same file;
3. how much slower the model computes beside as many copies of itself as the plan's ranks on one
   host compute at once (`autopart.profiling.co_run`), into the same database, per micro-batch
   size, precision and number of processes: the ranks compute at once and share the caches and
   the memory bus, where the in-place profile ran alone (not where the compile runs the plan's
   pipeline, 4., which measures each stage's compute inside it instead; where that run is not
   made after all, its steps too long or it failed, the compile measures the co-run then);
4. on a CPU, for a layout given in full, the plan's pipeline itself: the compile runs the
   programs it emits here for a few seconds and compiles again with what they took
   (``--profile-pipeline``, `autopart.profiling.pipeline`), into the same database, per mesh,
   micro-batch size, optimizer, precision and ZeRO level. A stage computes more slowly inside its pipeline than its ops
   alone or beside copies of the model (waking after a message, the other ranks' messages
   mid-compute, the tied gradients' and optimizer's tails), which none of the above sees
   (docs/first_run.md). A search does not: it runs its finalists instead
   (`autopart.profiling.finalists`).

A second compile of the same model finds them all and measures nothing (a pipeline is run
again where the figures it gave moved the plan's cuts to ones not run yet). ``--no-measure`` keeps the
roofline, and so does the environment variable ``AUTOPART_NO_MEASURE=1`` (the test suite sets it:
its compiles check plans, not this machine's speed, and must not each spend seconds measuring);
a named device (``a100-80gb``) is never measured: it is not here.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console

from autopart.ir.errors import ConfigError
from autopart.ir.model_file import ModelSpec
from autopart.passes.capture import Graph
from autopart.options import CompileOptions, local_kind
from autopart.predict.accuracy import Basis, basis_for
from autopart.profiling.co_run import host_processes
from autopart.profiling.in_situ import SHARES_SECONDS
from autopart.profiling.span import span
from cost_models.calibration import background_load, cache_dir, cache_slug, usable_cores, writable_cache_dir
from cost_models.comm_profile import QUICK, load_comm_profile, profile_comm
from cost_models.database import CostDatabase
from cost_models.devices import load_device, local_device_name

__all__ = ["NO_MEASURE_ENV", "RANKS_PER_CORE", "Measured", "co_run_processes", "measure_defaults", "costs_cache_path",
           "why_not_here"]

log = logging.getLogger("autopart")

NO_MEASURE_ENV = "AUTOPART_NO_MEASURE"
"""Set (to anything but empty), compiles measure nothing, as with ``--no-measure``."""

RANKS_PER_CORE = 2, 4
"""Ranks per core (on a CPU) up to which a compile runs plans here by default (a pinned plan's
pipeline, a search's finalists), and when asked: each launch starts every rank's interpreter and
torch, which take turns on the cores."""


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What `measure_defaults` found or measured, for the compile's report."""

    basis: Basis
    costs: Path | None = None
    """The cost database the compile reads (the cached one on the default path)."""
    ops_timed: int = 0
    """Ops timed now; 0 when the cache had them all."""
    messages_measured: bool = False
    """Whether the message figures were measured now (the cache had none)."""
    without_pipeline: Basis | None = None
    """Where the compile runs the plan's pipeline by default (not asked), the basis if that run fails."""


def costs_cache_path(model: Path, kind: str) -> Path:
    """The cached cost database of the model file ``model`` on this machine's ``kind`` device:
    per host, torch version and the hash of the model file and the files beside it that it imports
    (`autopart.ir.model_file.ModelSpec.sources_sha256`: an edited model is measured afresh, its
    co-run factor too, where the op keys alone would not tell an edit to ``layers.py``)."""
    from autopart.ir.model_file import load_model_file

    digest = load_model_file(model, build=False).sources_sha256[:16]
    host = cache_slug(f"{socket.gethostname()}-{local_device_name(kind)}-torch{torch.__version__}")
    return cache_dir() / "costs" / f"{host}-{Path(model).stem}-{digest}.json"


def co_run_processes(options: CompileOptions, kind: str | None, cores: int) -> int:
    """The processes a compile times its model's compute among (`autopart.profiling.co_run`):
    the plan's ranks on one host that compute at once, on this machine's CPU while measuring is
    on; 1 (alone, nothing to measure) otherwise, and where the compile runs the plan's pipeline
    (``--profile-pipeline``, by default for a layout given in full), which measures each stage's
    compute inside it and replaces the co-run's figure: a first compile would spend its seconds
    for nothing. Where that run is not made after all, the compile measures it then
    (`autopart.driver.measured_plan`)."""
    if options.profile_pipeline or not _measuring_cpu(options, kind):
        return 1
    return host_processes(options.ranks_per_host, cores)


def _host_ranks(options: CompileOptions, kind: str | None) -> int:
    """The plan's ranks on this machine, where its compute is timed here (1 otherwise)."""
    return options.ranks_per_host if _measuring_cpu(options, kind) else 1


def _measuring_cpu(options: CompileOptions, kind: str | None) -> bool:
    return kind == "cpu" and options.measure and not os.environ.get(NO_MEASURE_ENV)


def _messages_known(kind: str) -> bool:
    return load_comm_profile(local_device_name(kind)) is not None


def _can_measure_messages(kind: str) -> bool:
    """Messages need two processes: on a GPU, two devices (one rank each, as NCCL runs them)."""
    return kind == "cpu" or torch.cuda.device_count() >= 2


def measure_defaults(options: CompileOptions, *, console: Console | None = None,
                     progress: Callable[[str, int, int], None] | None = None,
                     search_size: Callable[[], int] | None = None) -> tuple[CompileOptions, Measured]:
    """``options`` reading this machine's measured costs, with what was measured to get them.

    Measures only on the default path: a local device, no ``--costs``, measuring not turned off.
    ``console`` shows a progress bar while measuring; ``progress(what, done, total)``, a search's
    bar already on the screen, hears what is measured instead (two live displays on one
    terminal overwrite each other's lines). ``search_size``, where the compile is a search: the
    micro-batch size it captures its model at first, asked where it is captured here for its
    refusals before the messages are measured (without it, the search's capture refuses after)."""
    kind = local_kind(options.device)
    missing = not Path(options.model).is_file()  # the compile says so in its own words
    if kind is None or options.costs is not None or not options.measure or os.environ.get(NO_MEASURE_ENV) or missing:
        messages = kind is not None and _messages_known(kind)
        database = CostDatabase.load(options.costs) if options.costs is not None and not missing else None
        hosts = database.measured_on() if database is not None else []
        costs = options.costs
        if kind is None and database is not None and load_device(options.device).name not in database.devices():
            costs = None  # ops of no other device are timed into it: the named device's roofline answers them all
        basis = basis_for(device=options.device, local=kind, measured=False, costs=costs, messages=messages,
                          pipeline=options.profile_pipeline, co_run=co_run_processes(options, kind, usable_cores()),
                          ranks_on_host=_host_ranks(options, kind), costs_hosts=tuple(hosts))
        return options, Measured(basis=basis, costs=options.costs)
    writable_cache_dir()
    path = costs_cache_path(options.model, kind)
    _unreadable_measured_again(path)
    by_default = not options.profile_pipeline and _pipeline_here(options, kind)
    pipeline = options.profile_pipeline or by_default
    measuring = replace(options, costs=path, profile_pipeline=pipeline)
    measure_messages = not _messages_known(kind) and _can_measure_messages(kind)
    # the ops before the messages: their capture refuses a model that cannot be compiled first; a
    # search or a plan file, which time none here, is captured for its refusals alone
    if options.searched or options.plan is not None:
        timed = 0
        first_size = search_size if options.searched else lambda: options.batch_shape()[2]
        if measure_messages and first_size is not None:
            _refused_capture(measuring, first_size())
    else:
        timed = _profile_ops(measuring, kind, path, console)
    what = "measuring messages between two processes on this machine (once)"
    status = nullcontext()
    if measure_messages and progress is not None:
        progress(what, 0, 0)
    elif measure_messages and console is not None:
        status = console.status(what)
    with status:
        if measure_messages:
            profile_comm(ranks=2, backend="gloo" if kind == "cpu" else "nccl", effort=QUICK)
    basis = functools.partial(basis_for, device=options.device, local=kind, measured=True, costs=None,
                              messages=_messages_known(kind), co_run=co_run_processes(options, kind, usable_cores()),
                              ranks_on_host=_host_ranks(options, kind))
    measured = Measured(basis=basis(pipeline=pipeline), costs=path, ops_timed=timed, messages_measured=measure_messages,
                        without_pipeline=basis(pipeline=False) if by_default else None)
    if measure_messages or timed:
        _note_busy(kind, path)
    return measuring, measured


def _unreadable_measured_again(path: Path) -> None:
    """The cached database, where it cannot be read as one (cut short, edited by hand, of another
    autopart's schema), replaced by an empty one, so that this compile measures the model again:
    the cache is autopart's own, and the error that a ``--costs`` file of the user's gets (give
    another) is no help for a file the user never named."""
    try:
        CostDatabase.load(path)
    except ConfigError:
        log.warning(f"the cached cost database {path} is not one this autopart can read; measuring the model "
                    "again in its place")
        CostDatabase(path=path).save()


def _pipeline_here(options: CompileOptions, kind: str) -> bool:
    """Whether the default compile runs the plan's pipeline here: a layout given in full (not a
    search, not a plan file), on this machine's CPU, its ranks on one host and at most
    `RANKS_PER_CORE` per core."""
    if kind != "cpu" or options.searched or options.plan is not None:
        return False
    return why_not_here(options, RANKS_PER_CORE[0]) is None


def why_not_here(options: CompileOptions, ranks_per_core: int) -> str | None:
    """Why the plan's ranks cannot run on this machine (a named device, more than one node, more
    than ``ranks_per_core`` per CPU core, fewer GPUs than ranks), or None where they can: the test
    of a search's finalists (`autopart.profiling.finalists`) and of the default pipeline run."""
    kind = local_kind(options.device)
    ranks = options.ranks
    if kind is None:
        return f"--device {options.device} is not this machine's"
    if ranks > options.gpus_per_node:
        return f"--world-size {ranks} spans more than one node of {options.gpus_per_node} (--gpus-per-node)"
    if kind == "cpu" and ranks > ranks_per_core * usable_cores():
        return f"--world-size {ranks} is more than {ranks_per_core} ranks per core of its {usable_cores()}"
    if kind != "cpu" and torch.cuda.device_count() < ranks:
        return f"it has {torch.cuda.device_count()} GPU(s) for --world-size {ranks}"
    return None


def _note_busy(kind: str, path: Path) -> None:
    """What was just measured is cached for good: say so when other work shared the cores, as
    a message's time and a rank's wake-up then include waiting for them."""
    cores = usable_cores()
    others = background_load(cores) if kind == "cpu" else 0.0
    if others >= cores:
        log.info(f"{others:g} other busy processes shared this machine's {cores} cores while its ops and messages "
                 f"were measured, which slows what was measured; on a quiet machine, delete {path} and "
                 "run 'autopart profile-comm' to measure again")


def _profile_ops(options: CompileOptions, kind: str, path: Path, console: Console | None) -> int:
    """Time in place the ops ``path`` lacks at the compile's micro-batch size and precision, with
    a progress bar; the ops of a search's other micro-batch sizes are timed as it reaches them.
    Only their shares where the plan's pipeline is run next, which sets each stage's level."""
    from autopart.profiling.profile import profile_costs

    micro_batch_size = options.batch_shape()[2]
    spec, graph = _refused_capture(options, micro_batch_size)  # a model to be refused is not timed first
    database = CostDatabase.load(path)
    timed = profile_costs(graph, spec, database, device=kind, micro_batch_size=micro_batch_size,
                          optimizer=options.optimizer, dtype=options.dtype, console=console,
                          processes=co_run_processes(options, kind, usable_cores()),
                          in_situ_seconds=span(SHARES_SECONDS) if options.profile_pipeline else None)
    if timed or not path.exists():
        database.save()
    return timed


def _refused_capture(options: CompileOptions, micro_batch_size: int) -> tuple[ModelSpec, Graph]:
    """The model file and its capture at ``micro_batch_size``, refused where the options ask of it
    what it cannot do (`autopart.passes.early_refusals`)."""
    from autopart.ir.model_file import load_model_file
    from autopart.passes.capture import capture
    from autopart.passes.early_refusals import refuse_early

    spec = load_model_file(options.model)
    graph = capture(spec, batch_size=micro_batch_size, method=options.capture, leaves=options.leaf)
    refuse_early(options, graph, spec)
    return spec, graph
