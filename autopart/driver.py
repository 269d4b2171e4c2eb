"""The driver: the passes in order, from a model file to a Plan and an output directory.

    load -> capture -> annotate -> blocks -> shard -> solve -> assemble (predict) -> Plan -> emit

(a search on the machine at hand runs its finalists here and keeps the fastest before emitting;
a layout given in full for this CPU runs here once, and is compiled again with what it took).

``compile(...)`` and ``emit(...)`` are the Python API; the command line builds the same
``CompileOptions`` and calls the same functions. Each step is one call into the package that
owns it: ``passes.front`` (load, capture, annotate, blocks, shard), ``solve`` (cuts, search,
plan assembly), ``codegen`` (the output directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import random
import time
from pathlib import Path

import torch

from autopart.codegen.emit import check_output_directory, emit_directory
from autopart.ir.errors import AutopartError, ConfigError, DeviceSpecError, PlanError
from autopart.ir.machine import physical_memory_bytes
from autopart.ir.model_file import load_model_file
from autopart.ir.plan import Plan, load_plan, plan_files_read_once
from autopart.options import CompileOptions, check_option_names, check_sequence_parallel_asked, local_kind
from autopart.predict.accuracy import Basis, with_basis
from autopart.predict.headroom import headroom_warning, over_device_warning
from autopart.passes.annotate import annotate
from autopart.passes.loss_reduction import check_mean_loss
from autopart.passes.early_refusals import warn_of_half_parameters
from autopart.passes.front import Front, build_front, capture_for, note_batch_statistics, note_unsplit
from autopart.profiling.finalists import finalists_run_here, run_finalists
from autopart.profiling.measure_defaults import co_run_processes, measure_defaults
from autopart.profiling.pipeline import affordable, profiled_in_place
from autopart.schedule import validation_beside
from autopart.solve.assemble import pipeline_problem, plan_from_cuts
from autopart.solve.pinned import check_same_model, rebuild_pinned
from autopart.solve.pipeline import solve_cuts
from autopart.solve.planner import plan_by_search, search_space
from autopart.solve.search import SearchSpace
from autopart.solve.stage_layers import check_fits, stage_layer_cuts
from autopart.tools.local_run import LocalRunError
from cost_models import CostModel, get_cost_model
from cost_models.calibration import usable_cores

log = logging.getLogger("autopart")

__all__ = ["CompileOptions", "compile", "compile_plan", "compile_to_directory", "emit"]


@contextlib.contextmanager
def cycle_collector_off():
    """CPython's cycle collector off while a compile runs, on again after (also on a failure)
    where the caller had it on.

    A compile makes millions of objects that live until it ends (graph nodes, schedule actions,
    timeline events) and few reference cycles. The collector walks each of them at least twice
    before it ends (as a young object, and again as a middle-aged one) however rare its passes
    are made, to free little: the cycles left are freed by the caller's next collection, and
    what holds much memory in cycles is freed where it is let go (the profiler's copies of the
    model, `autopart.profiling.profile.profile_costs`). docs/solver_scale.md has the figures."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@contextlib.contextmanager
def random_state_kept():
    """torch's generators (the CPU's, and CUDA's where there is CUDA) and Python's ``random`` left
    as the caller had them. A compile builds the model, whose file may seed torch itself (a
    ``build_model`` that calls ``torch.manual_seed(0)``), and runs it, which draws: else the
    caller's next draws would follow the compile's, and ``torch.initial_seed()`` be the model
    file's. What the compile draws is as without this: it starts from the caller's state.

    CUDA's generators are made when CUDA is first used; until then ``torch.manual_seed`` queues
    its seed for them, the caller's and the model file's alike. Where a compile that found them
    not yet made seeds torch or uses CUDA, the caller's seed is queued (or set) again."""
    python, seed = random.getstate(), torch.initial_seed()
    cuda = torch.cuda.is_available()
    made = cuda and torch.cuda.is_initialized()
    touched = False
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if made else []):
            try:
                yield
            finally:
                touched = torch.initial_seed() != seed or (cuda and torch.cuda.is_initialized())
    finally:
        random.setstate(python)
        if cuda and not made and touched:
            torch.cuda.manual_seed_all(seed)


def compile_plan(options: CompileOptions, progress=None) -> tuple[Plan, Front]:
    """The Plan of ``options`` and the front it was costed on (kept, so emitting needs no second capture)."""
    if options.searched:
        run_here = finalists_run_here(options)  # refused, where asked and impossible, before the search
        searched = plan_by_search(options, progress=progress, plan_every=run_here)
        if run_here:  # the step model picked the few; running them picks the one
            return run_finalists(searched.finalists, kind=local_kind(options.device),
                                 fresh=options.run_finalists is True, progress=progress)
        return searched.plan, searched.front
    if options.plan is not None:  # the plan decides everything it records
        return rebuild_pinned(options, load_plan(options.plan))
    batch = options.batch_shape()
    # its schedule validated beside the capture, unless the compile times this machine
    with validation_beside(options.schedule, options.pp, batch[1], options.chunks,
                           fork=local_kind(options.device) is None):
        return _fixed_layout_plan(options, batch)


def _fixed_layout_plan(options: CompileOptions, batch: tuple[int, int, int]) -> tuple[Plan, Front]:
    """The plan of a layout given in full: its cuts the user's or CP-SAT's."""
    front = build_front(options, batch[2])
    note_unsplit(options, front)
    problem = pipeline_problem(options, front, batch[1])
    if options.pins_layers:  # the cuts are the user's: predicted as they are, memory checked
        cuts = stage_layer_cuts(front.chain, options.stage_layers, stages=problem.stages,
                                first=options.first_stage_layers, last=options.last_stage_layers)  # fmt: skip
        return check_fits(plan_from_cuts(options, front, problem, cuts, batch, ("pinned", 0.0, 0.0)), problem), front
    solution = solve_cuts(problem, time_limit_s=options.time_limit_s)
    status = solution.status if problem.stages > 1 else "trivial"
    plan = plan_from_cuts(
        options, front, problem, solution.evaluation.cuts, batch, (status, solution.bound_s, solution.gap)
    )
    return check_fits(plan, problem, pinned=False), front


def compile(model: str | Path, **options) -> Plan:  # noqa: A001 - the API's verb
    """Compile ``model`` (a model file) into a Plan; ``emit(plan, out_dir)`` writes its programs.

    Keyword options are the fields of ``CompileOptions`` (``pp=2, microbatches=4, ...``). A
    search on the machine at hand runs its finalists here (`autopart.tools.local_run`), as the command line
    does, and keeps what they measured per model and machine (``run_finalists=False`` keeps the
    predicted order; ``run_finalists=True`` runs them afresh).
    """
    check_option_names(options)
    with plan_files_read_once():
        check_sequence_parallel_asked(sp=options.get("sp"), tp_overlap=options.get("tp_overlap", False),
                                      tp=options.get("tp"), world_size=options.get("world_size"),
                                      plan=options.get("plan"), pp=options.get("pp"), dp=options.get("dp"))
        with cycle_collector_off(), random_state_kept():
            plan, _ = measured_plan(CompileOptions(model=model, **options))
    return plan


def emit(plan: Plan, out_dir: str | Path) -> Path:
    """Write the output directory of ``plan``; the model file is captured again from the plan's provenance."""
    if not isinstance(plan, Plan):  # a path, most likely: the API's mistakes are autopart's errors, as compile's are
        shown = repr(plan) if isinstance(plan, (str, os.PathLike)) else f"{plan!r:.80}"  # a path whole, however long
        raise ConfigError(f"emit takes the Plan that autopart.compile returns, got {shown} "
                          f"({type(plan).__name__}); for a saved plan.json, pass autopart.load_plan(path)")
    if not isinstance(out_dir, (str, os.PathLike)):
        raise ConfigError(f"emit's out_dir must be a path (a str or pathlib.Path), got {out_dir!r:.80} "
                          f"({type(out_dir).__name__})")
    out_dir = Path(out_dir)
    check_output_directory(out_dir)
    with random_state_kept():  # the device's calibration, on first use, draws too
        cost_model = _cost_model_of(plan)
        spec = load_model_file(plan.provenance.model_file)
        if spec.source_sha256 != plan.provenance.model_sha256:
            raise PlanError(f"{spec.path} changed since this plan was compiled; compile it again")
        graph = capture_for(
            spec, plan.mesh["tp"], batch_size=plan.schedule.micro_batch_size, method=plan.provenance.capture,
            leaves=plan.provenance.leaves,
        )  # fmt: skip
        with cycle_collector_off():
            op_graph = annotate(graph, spec, cost_model, micro_batch_size=plan.schedule.micro_batch_size,
                                dtype=plan.dtype)
            return emit_directory(plan, op_graph, spec, out_dir)


def _cost_model_of(plan: Plan) -> CostModel:
    """The roofline of the device ``plan`` was costed for: its kind decides the precision each op
    runs in (CUDA's autocast lists under bf16), which the stage files show. A plan written before
    its provenance kept the device names it in its cost model ("roofline:h100-sxm")."""
    device = plan.provenance.device or plan.provenance.cost_model.rpartition(":")[2]
    try:
        return get_cost_model(device)
    except DeviceSpecError:  # a .toml moved since, or a spec of the user's known by its name alone
        raise PlanError(f"the plan was costed for device '{device}', which cannot be loaded here; emit it with "
                        "autopart compile MODEL --plan PLAN.json --device SPEC.toml -o OUT") from None


def compile_to_directory(options: CompileOptions, out_dir: Path, *, progress=None, console=None) -> tuple[Plan, Path]:
    """What ``autopart compile`` does: measure what the defaults need, compile, then emit, with
    one capture. ``progress(what, done, total)`` hears how the search goes; ``console`` shows
    the measuring."""
    check_output_directory(out_dir)
    with cycle_collector_off(), random_state_kept():
        plan, front = measured_plan(options, progress=progress, console=console)
        return plan, emit_directory(plan, front.op_graph, front.spec, out_dir, chain=front.chain)


def check_global_batch_fits(options: CompileOptions) -> None:
    """Refuse, before anything is built, measured or solved, batches that cannot be held where
    they are built: where the ranks run on this machine (its own device), each draws every global
    batch whole, so the ranks here hold it that many times; for a remote device the compile
    builds only batches of the micro-batch size (the ranks draw theirs on the cluster's nodes).
    A billion rows hung in building an example batch of that size. What else is wrong with the
    options or the model file is said where it was."""
    try:  # a search's layout is not known yet: its global batch is the one given, its micro-batches small
        memory = physical_memory_bytes()
        with random_state_kept():  # what the model file draws as it is imported and samples
            spec = load_model_file(options.model, build=False)
            sample = spec.sample_bytes
        here = local_kind(options.device) is not None
        if here:
            ranks = options.ranks_per_host  # --gpus-per-node: the ranks of a node, on a CPU cluster too
            samples = ranks * (options.global_batch_size if options.searched else options.batch_shape()[0])
            held = (f"{'the rank here draws' if ranks == 1 else f'the {ranks} ranks here each draw'} every global batch "
                    f"({samples // ranks} samples) whole")
        else:
            samples = 0 if options.searched else options.batch_shape()[2]
            held = f"the compile builds example batches of the micro-batch size, {samples} samples"
    except AutopartError:
        return
    if sample is not None and sample * samples > memory:
        raise ConfigError(f"{held}: {sample * samples / 2**30:,.1f} GiB of {spec.path.name}'s samples ({sample} bytes "
                          f"each), more than this machine's {memory / 2**30:.1f} GiB of memory; give a smaller "
                          f"{'--global-batch-size' if here else '--micro-batch-size'}")


def _smallest_size(space: SearchSpace) -> int:
    """The micro-batch size a search captures its model at first: the smallest it costs."""
    return min((layout.micro_batch_size for layout in space.layouts(1 << 30)), default=1)


def measured_plan(options: CompileOptions, *, progress=None, console=None) -> tuple[Plan, Front]:
    """Measure what the defaults need, compile, and where the plan is to run here first (asked
    with ``--profile-pipeline``, or by default, `autopart.profiling.measure_defaults`), run it and
    compile again; the plan carries what its prediction rests on. A run the user did not ask for
    that fails leaves the prediction on the ops and messages, with a warning that says why."""
    search_size = None
    if options.searched:  # its refusals of the options (no global batch) before anything is measured
        search_size = functools.partial(_smallest_size, search_space(options))
    if options.plan is not None:
        check_same_model(options, load_plan(Path(options.plan)))
    check_global_batch_fits(options)
    options, measured = measure_defaults(options, console=console, progress=progress, search_size=search_size)
    plan, front = compile_plan(options, progress)
    check_mean_loss(plan, front.op_graph.graph.loss_reduction, front.spec.path.name)  # before the plan runs here
    warn_of_half_parameters(options, front.spec)  # once a compile (its captures refuse, each of them)
    basis = measured.basis
    by_default = measured.without_pipeline is not None
    if by_default and not affordable(plan):
        log.info(f"the plan's steps are too long ({plan.predicted.step_s:.1f} s predicted) to run here by default; "
                 "the predicted step rests on its ops and messages (--profile-pipeline with --costs runs it)")
        basis = measured.without_pipeline
        plan, front = _without_run(options, plan, front, progress, console)
    elif options.profile_pipeline:
        try:
            plan, front = profiled_in_place(plan, front, lambda: compile_plan(options, progress), console=console)
        except LocalRunError as exc:
            if not by_default:  # asked for: the user hears it failed
                raise
            reason = str(exc).splitlines()[0]
            log.warning(f"running the plan here to measure its pipeline failed ({reason}); the predicted step rests "
                        "on its ops and messages alone")
            basis = measured.without_pipeline
            plan, front = _without_run(options, plan, front, progress, console)
    plan = with_basis(with_fewer_ranks(options, plan, basis, progress=progress), basis)
    device = front.cost_model.device
    tight = headroom_warning(plan, device_bytes=device.memory_bytes, kind=device.kind,
                             budget_chosen=options.memory_gib is not None)
    if tight:
        log.warning(tight)
    beyond = over_device_warning(plan, device_bytes=device.memory_bytes, device_name=device.name,
                                 memory_gib=options.memory_gib)
    if beyond:
        log.warning(beyond)
    note_batch_statistics(plan)
    return plan, front


def _without_run(options: CompileOptions, plan: Plan, front: Front, progress, console) -> tuple[Plan, Front]:
    """The plan compiled again where the pipeline run the default compile meant to make is not
    made: the model's compute beside the host's other ranks (`autopart.profiling.co_run`), which
    that run would have replaced and so was not timed, is timed now. ``plan`` as it is where the
    plan's ranks compute alone on this host (nothing was left untimed)."""
    without = dataclasses.replace(options, profile_pipeline=False)
    if co_run_processes(without, local_kind(options.device), usable_cores()) == 1:
        return plan, front
    showing = console.status("timing the model beside the host's other ranks (the pipeline's run was not made)") \
        if console is not None else contextlib.nullcontext()
    with showing:
        return compile_plan(without, progress)


def with_fewer_ranks(options: CompileOptions, plan: Plan, basis: Basis, *, cores: int | None = None,
                     progress=None) -> Plan:
    """Where a search's ranks outnumber this CPU's ``cores`` and its finalists ran here, ``plan``
    with the best plan of one rank per core in its search's record (``fewer_ranks``: its layout,
    predicted step and error band, ``faster`` where even at the band's worst, ``predicted / (1 -
    worst)``, it beats the step ``plan`` ran; ``reason`` where there is none). Ranks that share
    cores take turns on them, and a search of the world size asked cannot weigh that against
    fewer ranks: only the user can change the world size (the command line says so). It
    launches nothing; it may time ops at micro-batch sizes the first search did not cost."""
    cores = cores or usable_cores()
    search = plan.provenance.search
    ran_s = (search.get("ranked") or [{}])[0].get("measured_step_s")
    if local_kind(options.device) != "cpu" or not options.world_size or options.world_size <= cores \
            or not ran_s or basis.band is None:
        return plan
    start = time.perf_counter()
    try:
        fewer = plan_by_search(dataclasses.replace(options, world_size=cores, run_finalists=False),
                               progress=progress).plan
    except (AutopartError, RuntimeError, MemoryError) as exc:  # advice only: the plan stands as compiled
        record = {"world_size": cores, "reason": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
    else:
        banded = with_basis(fewer, basis).predicted  # a ZeRO-3 plan's own band; none for a layout no row ran
        worst, mesh = banded.error_worst, fewer.mesh
        record = {"world_size": cores, "layout": f"pp{mesh['pp']} tp{mesh['tp']} dp{mesh['dp']}",
                  "predicted_step_s": fewer.predicted.step_s, "error_worst": worst,
                  "error_benchmark": banded.error_benchmark,
                  "faster": worst is not None and worst < 1 and fewer.predicted.step_s / (1 - worst) < ran_s}
    record["seconds"] = round(time.perf_counter() - start, 3)
    return dataclasses.replace(plan, provenance=dataclasses.replace(plan.provenance,
                                                                    search=dict(search, fewer_ranks=record)))
