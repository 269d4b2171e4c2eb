"""The driver: the passes in order, from a model file to a Plan and an output directory.

    load -> capture -> annotate -> blocks -> solve -> (simulate) -> Plan -> emit

``compile(...)`` and ``emit(...)`` are the Python API; the command line builds the same
``CompileOptions`` and calls the same functions.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

import autopart
from autopart.annotate import DTYPES, OpGraph, annotate
from autopart.blocks import BlockChain, build_blocks
from autopart.capture import Graph, ModelSpec, capture, is_meta, load_model_file
from autopart.codegen.emit import check_output_directory, emit_directory
from autopart.codegen.stages import stage_boundaries
from autopart.errors import ConfigError, PlanError, ScheduleError
from autopart.plan import Plan, Predicted, Provenance, ScheduleSpec, StagePlan, first_difference, load_plan
from autopart.predict import simulate_pipeline
from autopart.runtime.materialise import check_initialisers
from autopart.runtime.optim import OPTIMIZERS
from autopart.runtime.recipe import embedding_parameters
from autopart.accuracy import with_basis
from autopart.measure_defaults import local_kind, measure_defaults
from autopart.profile import profile_costs
from autopart.profile_pipeline import pipeline_key, profile_pipeline
from autopart.recompute import recompute_cost, stage_input_bytes, stage_modes, transient_microbatches
from autopart.rewrite import separate_biases
from autopart.schedule import RECEIVE_KINDS, SCHEDULE_KINDS, Action, StageCosts, add_communication, build_schedule, stage_rank
from autopart.schedule.shared import step_time
from autopart.solver.pipeline import PipelineProblem, evaluate, solve_cuts, stage_ranges
from autopart.solver.sharding import REPLICATE, Placement
from autopart.solver.tensor import BlockSharding, shard_chain
from cost_models import CostDatabase, CostModel, ProfiledCostModel, get_cost_model, model_state_bytes
from cost_models.memory import communicator_bytes
from cost_models.database import PipelineMeasurement, plan_shape, tail_key
from cost_models.devices import DeviceSpec

__all__ = ["CompileOptions", "compile", "emit", "compile_to_directory"]

log = logging.getLogger("autopart")


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """Everything ``autopart compile`` takes; shared by the command line and the Python API."""

    model: Path
    """The model file (see the model-file contract)."""
    world_size: int | None = None
    """Devices to plan for. With it, every option left as None below is searched (see
    ``autopart.search``); without it, they take their defaults (one device, 1F1B, ...)."""
    pp: int | None = None
    """Pipeline stages (one rank each); 1 unless searched."""
    tp: int | None = None
    """Tensor-parallel degree: ranks that split each op of a stage (innermost, inside a node); 1 unless searched."""
    dp: int | None = None
    """Data-parallel degree: copies of the whole pipeline, each on its share of the batch; 1 unless searched."""
    zero: bool | None = None
    """Shard the optimizer state over the data-parallel group (ZeRO-1); off unless searched."""
    gpus_per_node: int = 8
    """Devices per node: collectives of groups larger than this cross nodes."""
    microbatches: int | None = None
    """Microbatches per step; by default twice the stages, or global batch / micro-batch size."""
    micro_batch_size: int | None = None
    """Samples per microbatch; the other way to fix the microbatch count."""
    global_batch_size: int | None = None
    """Samples per training step; by default microbatches x micro-batch size, or 8."""
    schedule: str | None = None
    """Pipeline schedule: gpipe, 1f1b, interleaved or zb-h1; 1f1b unless searched."""
    chunks: int | None = None
    """Model chunks per rank (interleaved schedule); 1 unless searched."""
    device: str = "cpu"
    """Device spec that costs and memory are predicted for (``cpu`` is calibrated here)."""
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
    """Activation recompute: "none", "selective" or "full" for every stage, or one per stage
    (``autopart.recompute``); none unless searched (then chosen per stage)."""
    dtype: str | None = None
    """Precision: "fp32", or "bf16" (forwards under torch.autocast, fp32 weights and gradients);
    "auto" lets the search choose; fp32 unless searched."""
    profile_pipeline: bool = False
    """Run the compiled programs here for a few steps, store how much longer their stages
    compute inside the running pipeline than alone in ``costs`` (`autopart.profile_pipeline`),
    and compile again with it. Once per model and mesh: a later compile finds it there."""
    measure: bool = True
    """Without ``costs``, on the machine at hand: measure its ops and messages first, once per
    model and machine (`autopart.measure_defaults`); False keeps the device's roofline."""

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "tp", "dp", "gpus_per_node"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.world_size is None:  # nothing is searched: what is not given takes its default
            for name, default in _DEFAULTS.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
        if self.zero and self.dp == 1:
            raise ConfigError("--zero shards the optimizer state over data-parallel ranks; it needs --dp 2 or more")
        if self.schedule is not None and self.schedule not in SCHEDULE_KINDS:
            raise ConfigError(f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULE_KINDS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        if self.chunks is not None and (self.chunks < 1 or (self.chunks > 1 and self.schedule not in (None, "interleaved"))):
            raise ConfigError(f"--chunks {self.chunks} needs --schedule interleaved (other schedules use 1 chunk)")
        for name in ("microbatches", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.capture not in (None, "fx", "export"):
            raise ConfigError(f"unknown capture method {self.capture!r}; use --capture fx or --capture export")
        if self.leaf and self.capture == "export":
            raise ConfigError("--leaf keeps modules opaque to torch.fx, which torch.export cannot do; drop --capture export")
        if self.memory_gib is not None and self.memory_gib <= 0:
            raise ConfigError(f"--memory must be positive, got {self.memory_gib}")
        if self.dtype not in (None, *DTYPES, "auto"):
            raise ConfigError(f"unknown --dtype {self.dtype!r}; use one of {', '.join(DTYPES)} or auto")
        if self.dtype == "auto" and self.world_size is None:
            raise ConfigError("--dtype auto lets the search choose the precision; add --world-size N to search")
        if self.profile_pipeline and self.costs is None:
            raise ConfigError("--profile-pipeline keeps what it measures in a cost database: add --costs COSTS.json")
        if self.profile_pipeline and local_kind(self.device) != "cpu":
            raise ConfigError(f"--profile-pipeline runs the plan on this machine's CPU, so it profiles plans for "
                              f"--device cpu, not {self.device}")
        if self.recompute is not None:
            if self.pp is not None and self.chunks is not None:
                stage_modes(self.recompute, self.pp * self.chunks)
            elif not isinstance(self.recompute, str):
                raise ConfigError("--recompute with one mode per stage needs the stages pinned: add --pp (and --chunks)")
            else:
                stage_modes(self.recompute, 1)

    @property
    def searched(self) -> bool:
        """Some choice is left to the search (``world_size`` given, the plan not pinned)."""
        return self.world_size is not None and self.plan is None

    @property
    def pipeline_crosses_nodes(self) -> bool:
        """The ranks of one pipeline (and so its transfers and gradient reductions) span several nodes."""
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
        if m is None and b is None:
            m = max(d for d in range(1, 2 * self.pp + 1) if share % d == 0)
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
        if self.schedule == "interleaved" and m % self.pp:
            raise ConfigError(
                f"interleaved needs microbatches ({m}) to be a multiple of the pipeline degree ({self.pp}); "
                f"use --microbatches {self.pp * -(-m // self.pp)}"
            )
        return total, m, b


_DEFAULTS = {"pp": 1, "tp": 1, "dp": 1, "zero": False, "schedule": "1f1b", "chunks": 1, "recompute": "none",
             "dtype": "fp32"}
"""What the options not given are when nothing is searched."""


@dataclass(frozen=True, kw_only=True)
class _Front:
    """What the front passes give: kept so that emitting needs no second capture."""

    spec: ModelSpec
    op_graph: OpGraph
    chain: BlockChain
    cost_model: CostModel = field(repr=False)
    shardings: tuple[BlockSharding, ...] | None = None  # per block, when tp > 1
    timed: int = 0  # ops timed for the cost database during this compile


def _capture(spec: ModelSpec, tp: int, **how) -> Graph:
    """The training graph, with biases as ops of their own when ops will be split (see rewrite.py)."""
    graph = capture(spec, **how)
    return separate_biases(graph) if tp > 1 else graph


def _front(options: CompileOptions, micro_batch_size: int) -> _Front:
    return _sharded(_annotated(options, micro_batch_size, separate_biases=options.tp > 1), options)


def _sharded(front: _Front, options: CompileOptions) -> _Front:
    """``front`` with every block's tensor-parallel strategy chosen for ``options.tp``."""
    if options.tp == 1:
        return replace(front, shardings=None)
    across = options.tp > options.gpus_per_node
    shardings = tuple(shard_chain(front.chain, tp=options.tp, cost_model=front.cost_model, across_nodes=across))
    return replace(front, shardings=shardings)


def _note_unsplit(options: CompileOptions, front: _Front) -> None:
    """A --tp that divides no weight runs the whole model on every rank of its group: say so."""
    if front.shardings and not any(p.kind == "S" for sharding in front.shardings for p in sharding.parameters.values()):
        log.info(f"--tp {options.tp} splits no weight of {front.spec.path.name}: none divides {options.tp} ways, or"
                 f" splitting would be slower than running it whole; each of the {options.tp} ranks holds and computes"
                 " the whole model (lower --tp, or use --pp or --dp)")


def _annotated(options: CompileOptions, micro_batch_size: int, *, separate_biases: bool,
               spec: ModelSpec | None = None, roofline: CostModel | None = None,
               measured: dict[str, tuple] | None = None, graph: Graph | None = None) -> _Front:
    """Capture, cost and cut into blocks; ``separate_biases`` for graphs whose ops will be split.
    ``spec`` and ``roofline``: the model and device cost model of an earlier call, to reuse;
    ``measured``: ops' kernels and times by cost key (``annotate``), shared by calls that cost
    alike (without a cost database, which may gain entries between calls); ``graph``: an earlier
    fx capture of the same model at any micro-batch size (fx graphs hold no batch size)."""
    roofline = roofline or get_cost_model(options.device)  # a bad device spec fails before the slow passes
    if spec is None:
        spec = load_model_file(options.model)
        if is_meta(spec.module):  # each rank will make its own weights: every module needs an initialiser
            check_initialisers(spec.module, spec.init_weights, spec.path.name)
    if graph is None or graph.method != "fx":
        graph = _capture(spec, 2 if separate_biases else 1, batch_size=micro_batch_size, method=options.capture,
                         leaves=options.leaf)
    database, timed = None, 0
    if options.costs is not None:
        database = CostDatabase.load(options.costs)
        local = local_kind(options.device)
        if local is not None:
            timed = profile_costs(graph, spec, database, device=local, micro_batch_size=micro_batch_size,
                                  optimizer=options.optimizer, dtype=options.dtype)
            if timed:
                database.save()
    cost_model = roofline if database is None else ProfiledCostModel(roofline=roofline, database=database)
    op_graph = annotate(graph, spec, cost_model, micro_batch_size=micro_batch_size, dtype=options.dtype,
                        measured=measured if database is None else None)
    chain = build_blocks(op_graph)
    return _Front(spec=spec, op_graph=op_graph, chain=chain, cost_model=cost_model, timed=timed)


def _parameter_placements(front: _Front) -> dict[str, Placement]:
    placements: dict[str, Placement] = {}
    for sharding in front.shardings or ():
        placements.update(sharding.parameters)
    return placements


def _block_times(front: _Front) -> list[tuple[float, float, float]]:
    """Per block: forward, backward and weight-gradient seconds on one rank, after sharding."""
    times = []
    for k, block in enumerate(front.chain.blocks):
        scale = 1.0
        if front.shardings is not None and block.forward_s + block.backward_s > 0:
            scale = front.shardings[k].time_s / (block.forward_s + block.backward_s)
        times.append((block.forward_s * scale, block.backward_s * scale, block.backward_weight_s * scale))
    return times


def _recompute_blocks(front: _Front, modes: list[str]) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Per block, in the recompute mode of its stage: forward and backward seconds (the recompute
    included), and the bytes it holds per microbatch in flight (a stage's inputs not included)."""
    times, held = [], []
    for k, (block, (forward, backward, _)) in enumerate(zip(front.chain.blocks, _block_times(front))):
        cost = recompute_cost([block], modes[k], input_bytes=0)
        scale = forward / block.forward_s if block.forward_s > 0 else 1.0  # the tensor-parallel share
        shard = front.shardings[k].saved_bytes / block.saved_bytes if front.shardings and block.saved_bytes else 1.0
        times.append(forward + backward + cost.extra_backward_s * scale)
        held.append(round(cost.saved_bytes * shard))
    return tuple(times), tuple(held)


def _in_flight(kind: str, ranks: int, microbatches: int, chunks: int) -> tuple[int, ...]:
    """Microbatches whose activations each stage holds at its peak, from the schedule itself."""
    stages = ranks * chunks
    timeline = simulate_pipeline(
        kind=kind,
        ranks=ranks,
        microbatches=microbatches,
        chunks=chunks,
        forward_s=(1.0,) * stages,
        backward_s=(2.0,) * stages,
        weight_s=(1.0,) * stages,
        transfer_s=(0.0,) * (stages - 1),
    )
    return timeline.peak_in_flight


def _problem(options: CompileOptions, front: _Front, microbatches: int) -> PipelineProblem:
    chain, cost_model = front.chain, front.cost_model
    stages = options.pp * options.chunks
    device = cost_model.device
    memory = round(options.memory_gib * (1 << 30)) if options.memory_gib is not None else device.memory_bytes
    placements = _parameter_placements(front)
    # The cuts are not known yet: with one recompute mode for every stage the blocks carry its
    # figures (a stage's inputs, which recompute keeps, are left out); with modes that differ per
    # stage they carry no recompute's. _plan_from_cuts computes the chosen stages' figures exactly.
    modes = set(stage_modes(options.recompute, stages))
    times, saved = _recompute_blocks(front, [modes.pop() if len(modes) == 1 else "none"] * len(chain.blocks))
    return PipelineProblem(
        block_time_s=times,
        block_activation_bytes=saved,
        boundary_transfer_s=tuple(
            cost_model.p2p_time(boundary.nbytes, across_nodes=options.pipeline_crosses_nodes)
            for boundary in chain.boundaries
        ),
        parameter_state_bytes={
            name: _state_bytes(options, nbytes // (options.tp if placements.get(name, REPLICATE).kind == "S" else 1))
            for name, nbytes in chain.parameter_bytes.items()
        },
        block_parameters=tuple(b.parameters for b in chain.blocks),
        stages=stages,
        microbatches=microbatches,
        in_flight=_in_flight(options.schedule, options.pp, microbatches, options.chunks),
        memory_limit_bytes=memory,
        overhead_bytes=device.framework_overhead_bytes
        + communicator_bytes(device.kind, pp=options.pp, tp=options.tp, dp=options.dp),
        stage_rank=tuple(stage_rank(s, options.pp) for s in range(stages)),
    )


def _state_bytes(options: CompileOptions, parameter_bytes: int) -> int:
    """Weights, gradients and optimizer state of one rank's share of a parameter."""
    return state_bytes(parameter_bytes, optimizer=options.optimizer, dp=options.dp, zero=options.zero)


def state_bytes(parameter_bytes: int, *, optimizer: str, dp: int, zero: bool) -> int:
    """Weights, gradients and optimizer state of ``parameter_bytes`` of parameters on one rank;
    with ZeRO-1 the optimizer state is shared out over the ``dp`` data-parallel ranks."""
    full = model_state_bytes(parameter_bytes, optimizer=optimizer)
    if not zero:
        return full
    weights_and_grads = 2 * parameter_bytes
    return weights_and_grads + (full - weights_and_grads) // dp


def _plan_from_cuts(
    options: CompileOptions,
    front: _Front,
    problem: PipelineProblem,
    cuts: tuple[int, ...],
    batch: tuple[int, int, int],
    solver: tuple[str, float, float],
) -> Plan:
    chain = front.chain
    ranges = stage_ranges(cuts, len(chain.blocks))
    problem, recompute = _with_recompute(options, front, problem, ranges)
    evaluation = evaluate(problem, cuts)
    stage_nodes = [tuple(n for k in r for n in chain.blocks[k].nodes) for r in ranges]
    sends = stage_boundaries(front.op_graph, stage_nodes)
    metas = {name: cost.output for name, cost in front.op_graph.nodes.items()}
    graph_inputs = front.op_graph.graph.input_names
    holders: dict[str, list[int]] = {}
    block_times = _block_times(front)
    stages = []
    for s, r in enumerate(ranges):
        blocks = [chain.blocks[k] for k in r]
        parameters = tuple(dict.fromkeys(p for b in blocks for p in b.parameters))
        for p in parameters:
            holders.setdefault(p, []).append(s)
        needed = _batch_inputs(front.op_graph, stage_nodes[s], graph_inputs)
        times = [block_times[k] for k in r]
        strategies = {
            n: str(strategy)
            for k in r
            for n, strategy in (front.shardings[k].strategies.items() if front.shardings else ())
            if strategy.output != REPLICATE or strategy.kind
        }
        placements = _parameter_placements(front)
        backward = sum(problem.block_time_s[k] for k in r) - sum(f for f, _, _ in times)  # recompute included
        stages.append(
            StagePlan(
                index=s,
                rank=problem.rank_of(s),
                blocks=(r.start, r.stop - 1),
                nodes=stage_nodes[s],
                inputs=tuple((n, metas[n]) for n in (sends[s - 1] if s > 0 else ())),
                outputs=tuple((n, metas[n]) for n in (sends[s] if s < len(sends) else ())),
                batch_inputs=needed,
                parameters=parameters,
                forward_s=sum(f for f, _, _ in times),
                backward_s=backward,
                # a stage whose backward is all weight gradients (the embedding alone): equal, not a rounding apart
                backward_weight_s=min(backward, sum(w for _, _, w in times)),
                parameter_bytes=sum(chain.parameter_bytes[p] for p in parameters),
                activation_bytes=sum(problem.block_activation_bytes[k] for k in r),
                strategies=strategies,
                parameter_placements={p: str(placements[p]) for p in parameters if placements.get(p, REPLICATE) != REPLICATE},
                recompute=recompute[s].mode,
            )
        )
    transfer = tuple(
        front.cost_model.p2p_time(
            sum(m.nbytes for _, m in st.outputs), across_nodes=options.pipeline_crosses_nodes
        )
        for st in stages[:-1]
    )
    total, microbatches, micro_batch_size = batch
    timeline = simulate_pipeline(
        kind=options.schedule,
        ranks=options.pp,
        microbatches=microbatches,
        chunks=options.chunks,
        forward_s=tuple(s.forward_s for s in stages),
        backward_s=tuple(s.backward_s for s in stages),
        weight_s=tuple(s.backward_weight_s for s in stages),
        transfer_s=transfer,
    )
    in_place = _in_place(options, front, micro_batch_size)
    tails = _rank_tails(options, front, stages, holders, in_place)
    factor = _compute_factor(options, front, stages, in_place)
    step_s = _step_time(options, front, stages, transfer, tails, microbatches, factor, in_place)
    status, bound, gap = solver
    gradient_sync = _data_parallel_seconds(options, front, stages)
    return Plan(
        mesh={"pp": options.pp, "tp": options.tp, "dp": options.dp},
        stages=tuple(stages),
        schedule=ScheduleSpec(
            kind=options.schedule,
            microbatches=microbatches,
            micro_batch_size=micro_batch_size,
            global_batch_size=total,
            chunks=options.chunks,
        ),
        predicted=Predicted(
            step_s=step_s + gradient_sync,
            bubble=timeline.bubble,
            memory_bytes=_with_transients(options, evaluation.rank_memory_bytes, recompute, microbatches),
            p2p_bytes_per_step=2 * microbatches * sum(sum(m.nbytes for _, m in st.outputs) for st in stages),
            stage_time_s=evaluation.stage_time_s,
            transfer_s=transfer,
            pipeline_s=timeline.step_s,
            rank_tail_s=tuple(tails[r] for r in range(options.pp)),
            compute_factor=factor[0],
            compute_factor_from=factor[1],
            profiled_step_s=_profiled_step(options, stages, microbatches, in_place),
            background_load=front.cost_model.device.background_load,
            model_flops_per_step=_model_flops(front.op_graph, total),
            peak_flops=_peak_flops(front.cost_model.device, options.dtype),
        ),
        provenance=Provenance(
            model_file=str(front.spec.path.resolve()),
            model_sha256=front.spec.source_sha256,
            capture=front.op_graph.graph.method,
            leaves=options.leaf,
            cost_model=front.cost_model.name,
            solver_status=status,
            objective_s=evaluation.objective_s,
            bound_s=bound,
            gap=gap,
            autopart_version=autopart.__version__,
            torch_version=torch.__version__,
        ),
        zero=options.zero,
        graph_inputs=graph_inputs,
        optimizer=options.optimizer,
        tied_parameters={p: tuple(s) for p, s in holders.items() if len(s) > 1},
        dtype=options.dtype,
        embedding_parameters=embedding_parameters(front.spec.module) if front.spec.module is not None else (),
    )


def _model_flops(op_graph: OpGraph, global_batch_size: int) -> float:
    """The model's FLOPs of one step (forward and backward, without recompute's), from the ops'
    FLOPs at the annotated microbatch size: what MFU counts as useful work."""
    per_sample = sum(n.forward_flops + n.backward_flops for n in op_graph.nodes.values()) / op_graph.micro_batch_size
    return per_sample * global_batch_size


def _peak_flops(device: DeviceSpec, dtype: str) -> float:
    """The device's dense peak for the plan's matrix products: bf16, or fp32 (TF32 where the spec runs fp32 so)."""
    if dtype == "bf16":
        return device.peak_flops["bfloat16"]
    return device.peak_flops["tf32" if device.fp32_matmul_uses_tf32 else "float32"]


def _with_recompute(options: CompileOptions, front: _Front, problem: PipelineProblem, ranges: list[range]):
    """The problem with every block in its stage's recompute mode and each recomputing stage's inputs
    held, so that evaluating the cuts gives the chosen stages' exact figures; and per stage its
    `RecomputeCost`."""
    modes = stage_modes(options.recompute, len(ranges))
    times, held = _recompute_blocks(front, [modes[s] for s, r in enumerate(ranges) for _ in r])
    held = list(held)
    costs = []
    for s, r in enumerate(ranges):
        inputs = stage_input_bytes(front.chain, r.start, r.stop - 1)
        costs.append(recompute_cost([front.chain.blocks[k] for k in r], modes[s], input_bytes=inputs))
        if modes[s] != "none":  # checkpoint keeps the stage's arguments (whole on every tensor-parallel rank)
            held[r.start] += inputs
    return replace(problem, block_time_s=times, block_activation_bytes=tuple(held)), costs


def _with_transients(options: CompileOptions, memory: tuple[int, ...], recompute: list, microbatches: int):
    """Each rank's peak plus the recomputed activations of the backward(s) in progress on it."""
    schedule = build_schedule(options.schedule, ranks=options.pp, microbatches=microbatches, chunks=options.chunks)
    at_once = transient_microbatches(schedule, len(recompute))
    peaks = list(memory)
    for rank in range(options.pp):
        here = [s for s in range(len(recompute)) if stage_rank(s, options.pp) == rank]
        peaks[rank] += max((recompute[s].transient_bytes // options.tp * at_once[s] for s in here), default=0)
    return tuple(peaks)


def _data_parallel_seconds(options: CompileOptions, front: _Front, stages: list[StagePlan]) -> float:
    """The gradient all-reduce over the data-parallel group after the pipeline drains (not
    overlapped); with ZeRO-1, also the broadcast of each rank's updated shard to the others (an
    all-gather's traffic). The group spans nodes once the whole mesh does (dp is outermost)."""
    if options.dp == 1:
        return 0.0
    across = options.pp * options.tp * options.dp > options.gpus_per_node
    per_rank: dict[int, float] = {}
    for stage in stages:
        share = stage.parameter_bytes / options.tp
        seconds = front.cost_model.collective_time("all_reduce", share, options.dp, across_nodes=across)
        if options.zero:
            seconds += front.cost_model.collective_time("all_gather", share, options.dp, across_nodes=across)
        per_rank[stage.rank] = per_rank.get(stage.rank, 0.0) + seconds
    return max(per_rank.values())


def _rank_tails(options: CompileOptions, front: _Front, stages: list[StagePlan], holders: dict[str, list[int]],
                in_place: PipelineMeasurement | None) -> dict[int, float]:
    """Per rank, what the step does after the pipeline: sum tied gradients, step the optimizer;
    each as this pipeline measured it where it was run (``in_place``), else modelled."""
    cost_model = front.cost_model
    metas = {str(n.target): front.op_graph.nodes[n.name].output
             for n in front.op_graph.fx_nodes() if front.op_graph.nodes[n.name].is_parameter}
    for leaf in front.op_graph.leaf_tensors.values():  # the weights of --leaf modules
        metas.update(leaf)
    tails = {}
    for rank in range(options.pp):
        held = dict.fromkeys(p for st in stages if st.rank == rank for p in st.parameters)
        tied = sum(cost_model.collective_time("all_reduce", metas[p].nbytes, len({stages[s].rank for s in holders[p]}))
                   for p in held if len(holders[p]) > 1)
        if tied and in_place is not None and in_place.tied_s is not None:
            tied = in_place.tied_s
        measured = in_place.optimizer_time([st.blocks for st in stages if st.rank == rank]) if in_place else None
        optimizer = cost_model.optimizer_time(options.optimizer, [(metas[p].shape, metas[p].dtype) for p in held])
        if options.zero:  # each data-parallel rank steps its shard of the state
            optimizer /= options.dp
        if measured is not None:
            optimizer = measured
        tails[rank] = tied + optimizer
    return tails


def _in_place(options: CompileOptions, front: _Front, micro_batch_size: int) -> PipelineMeasurement | None:
    """What this very pipeline measured as it ran (``--profile-pipeline``), if it was."""
    mesh = {"pp": options.pp, "tp": options.tp, "dp": options.dp}
    key = pipeline_key(front.spec.source_sha256, mesh, micro_batch_size, options.optimizer)
    return front.cost_model.pipeline_profile(key)


def _profiled_step(options: CompileOptions, stages: list[StagePlan], microbatches: int,
                   in_place: PipelineMeasurement | None) -> float | None:
    """The median step this very plan took when ``--profile-pipeline`` ran it, if it did."""
    if in_place is None or in_place.step_of != plan_shape(options.schedule, microbatches, [s.blocks for s in stages]):
        return None
    return in_place.step_s


def _compute_factor(options: CompileOptions, front: _Front, stages: list[StagePlan],
                    in_place: PipelineMeasurement | None) -> tuple[tuple[float, ...], str]:
    """Per stage, how many times its profiled time each forward and backward takes inside this
    pipeline, and where the figures are from: "pipeline" where this very pipeline was run and
    measured (``--profile-pipeline``), "device" for the device's own (``profile-comm`` on a CPU), "none"."""
    if in_place is not None:
        return tuple(in_place.stage_factor(stage.blocks) for stage in stages), "pipeline"
    # a rank computes beside the others and their messages
    device = front.cost_model.pipeline_compute_factor() if options.pp > 1 else 1.0
    return (device,) * len(stages), "device" if device != 1.0 else "none"


def _step_time(options: CompileOptions, front: _Front, stages: list[StagePlan], transfer: tuple[float, ...],
               tails: dict[int, float], microbatches: int, factor: tuple[tuple[float, ...], str],
               in_place: PipelineMeasurement | None) -> float:
    """The step as the runtime times it: the pipeline with the fixed cost of each action, each
    forward and backward of stage s ``factor[0][s]`` times its profiled time, its messages as
    this pipeline measured them where it was run (``in_place``), on ranks that share the device's
    cores when it has them, then each rank's tail. Where this pipeline was run, the median of its
    steps replayed: each step measured there with its actions, deliveries and tails as they
    moved from their medians in that step. A step waits for its slowest rank and its latest
    message, and a busy machine's slow moments catch the ranks at different times, so the step
    of the median action times is shorter than the median step (by 8-10% here at 2 ranks)."""
    overheads = front.cost_model.runtime_overheads
    fixed = [overheads.action_costs(recompute=s.recompute != "none", split=options.schedule == "zb-h1")
             for s in stages]
    # per boundary, the rank time of its messages (one per tensor) on each side; the rest is latency
    sides = [[front.cost_model.p2p_rank_time(m.nbytes, across_nodes=options.pipeline_crosses_nodes)
              for _, m in st.outputs] for st in stages[:-1]]
    send = tuple(sum(s for s, _ in boundary) for boundary in sides)
    receive = tuple(sum(r for _, r in boundary) for boundary in sides)
    waited: tuple[float, ...] = ()
    if in_place is not None and in_place.transfer_s is not None:  # one message per boundary, as measured
        send, receive = (in_place.send_s,) * len(sides), (in_place.recv_s,) * len(sides)
        transfer = tuple(in_place.send_s + in_place.recv_s + in_place.transfer_s for _ in sides)
        if in_place.waited_s is not None:  # a receive that waits ends waited_s after its send
            waited = (min(in_place.recv_s, in_place.waited_s),) * len(sides)
    schedule = add_communication(
        build_schedule(options.schedule, ranks=options.pp, microbatches=microbatches,
                       chunks=options.chunks), ranks=options.pp)
    device = front.cost_model.device
    # the other tensor- and data-parallel ranks of the machine run the same work beside this pipeline
    cores = device.cores / (options.tp * options.dp)
    # measured in place, the factor holds what waking and refilling a shared core cost the compute
    resume = (0.0, 0.0) if in_place is not None else (overheads.resume_forward_s, overheads.resume_backward_s)

    slower = factor[0]
    costs = StageCosts(
        forward_s=tuple(f * s.forward_s + x[0] for f, s, x in zip(slower, stages, fixed)),
        backward_s=tuple(f * s.backward_s + x[1] for f, s, x in zip(slower, stages, fixed)),
        weight_s=tuple(f * s.backward_weight_s + x[2] for f, s, x in zip(slower, stages, fixed)),
        transfer_s=tuple(max(0.0, t - s - r) for t, s, r in zip(transfer, send, receive)),
        send_s=send,
        recv_s=receive,
        recv_waited_s=waited,
    )

    def step(costs: StageCosts, tails: dict[int, float]) -> float:
        return step_time(schedule, costs, ranks=options.pp, cores=cores, background=device.background_load,
                         tail_s=tails, resume_s=resume, busy_delay_s=front.cost_model.p2p_busy_delay(),
                         wake_s=None if in_place is not None else front.cost_model.wake_time)

    if in_place is None or not in_place.step_variation:
        return step(costs, tails)
    actions = [action for on_rank in schedule.values() for action in on_rank]
    return statistics.median(
        step(replace(costs, actions=_replayed(costs, actions, moved)),
             {rank: seconds * moved.get(tail_key(rank), 1.0) for rank, seconds in tails.items()})
        for moved in in_place.step_variation
    )


def _replayed(costs: StageCosts, actions: list[Action], moved: dict[str, float]) -> dict[Action, float]:
    """The actions' times in one measured step (`PipelineMeasurement.step_variation`): each
    compute action and send its time times its multiple, each receive its time plus the
    lateness of its delivery."""
    times = {}
    for action in actions:
        change = moved.get(str(action))
        if change is not None:
            receive = action.kind in RECEIVE_KINDS
            times[action] = max(0.0, costs.duration(action) + change) if receive else costs.duration(action) * change
    return times


def _batch_inputs(op_graph: OpGraph, nodes: tuple[str, ...], graph_inputs: tuple[str, ...]) -> tuple[str, ...]:
    """The graph inputs that a stage's nodes reach through batch-derived nodes alone."""
    fx_nodes = {n.name: n for n in op_graph.fx_nodes()}
    found: set[str] = set()
    seen: set[str] = set()
    stack = [a for n in nodes for a in fx_nodes[n].all_input_nodes]
    while stack:
        node = stack.pop()
        if node.name in seen or not (op_graph.nodes[node.name].batch_derived and node.op != "get_attr"):
            continue
        seen.add(node.name)
        if node.op == "placeholder":
            found.add(node.name)
        stack.extend(node.all_input_nodes)
    return tuple(n for n in graph_inputs if n in found)


def _compile(options: CompileOptions, progress=None) -> tuple[Plan, _Front]:
    if options.searched:
        from autopart.planner import plan_by_search  # the search drives this module's passes

        searched = plan_by_search(options, progress=progress)
        return searched.plan, searched.front
    if options.plan is not None:  # the plan decides everything it records
        return _pinned(options, load_plan(options.plan))
    batch = options.batch_shape()
    front = _front(options, batch[2])
    _note_unsplit(options, front)
    problem = _problem(options, front, batch[1])
    solution = solve_cuts(problem, time_limit_s=options.time_limit_s)
    status = solution.status if problem.stages > 1 else "trivial"
    plan = _plan_from_cuts(
        options, front, problem, solution.evaluation.cuts, batch, (status, solution.bound_s, solution.gap)
    )
    return plan, front


def _pinned(options: CompileOptions, pinned: Plan) -> tuple[Plan, _Front]:
    """The plan of ``--plan``, rebuilt for the model; refused in one line naming the first field
    that the model or the plan's other fields contradict."""
    try:
        options = replace(
            options,
            pp=pinned.mesh["pp"],
            tp=pinned.mesh["tp"],
            dp=pinned.mesh["dp"],
            schedule=pinned.schedule.kind,
            chunks=pinned.schedule.chunks,
            microbatches=pinned.schedule.microbatches,
            micro_batch_size=None,  # each replica's, which the global batch, microbatches and dp fix
            global_batch_size=pinned.schedule.global_batch_size,
            optimizer=pinned.optimizer,
            zero=pinned.zero,
            recompute=tuple(stage.recompute for stage in pinned.stages),
            dtype=pinned.dtype,
            capture=pinned.provenance.capture if pinned.provenance.capture in ("fx", "export") else None,
            leaf=pinned.provenance.leaves,
        )
        batch = options.batch_shape()
        front = _front(options, batch[2])
        problem = _problem(options, front, batch[1])
        cuts = _pinned_cuts(pinned, options, front)
        plan = _plan_from_cuts(options, front, problem, cuts, batch, ("pinned", 0.0, 0.0))
    except (ConfigError, ScheduleError) as exc:
        raise PlanError(f"{options.plan} does not fit together: {exc}") from None
    difference = first_difference(pinned, plan)
    if difference is not None:
        field_path, given, expected = difference
        costs = pinned.provenance.cost_model, plan.provenance.cost_model
        hint = f" (it was costed with {costs[0]}, this compile with {costs[1]}: pass its --device)" if costs[0] != costs[1] else ""
        raise PlanError(
            f"{options.plan}: {field_path} is {json.dumps(given)[:80]} but this model and the plan's other fields "
            f"give {json.dumps(expected)[:80]}{hint}; fix the field, or recompile without --plan"
        )
    return plan, front


def _pinned_cuts(plan: Plan, options: CompileOptions, front: _Front) -> tuple[int, ...]:
    """The cuts of a hand-written or earlier plan, checked against this model."""
    if plan.provenance.model_sha256 != front.spec.source_sha256:
        raise PlanError(
            f"{options.plan} was compiled from another version of {front.spec.path.name} "
            "(its model hash differs); recompile without --plan"
        )
    block_ending_at = {b.nodes[-1]: k for k, b in enumerate(front.chain.blocks)}
    cuts = []
    for stage in plan.stages[:-1]:
        if not stage.nodes or stage.nodes[-1] not in block_ending_at:
            raise PlanError(
                f"plan stage {stage.index} does not end on a block of this model (it ends at node "
                f"{stage.nodes[-1] if stage.nodes else None!r}); move its last node to a block boundary or recompile"
            )
        cuts.append(block_ending_at[stage.nodes[-1]])
    if len(plan.stages) != options.pp * options.chunks or cuts != sorted(set(cuts)):
        raise PlanError(f"{options.plan} has {len(plan.stages)} stages out of order or not pp x chunks; recompile")
    return tuple(cuts)


def compile(model: str | Path, **options) -> Plan:  # noqa: A001 - the API's verb
    """Compile ``model`` (a model file) into a Plan; ``emit(plan, out_dir)`` writes its programs.

    Keyword options are the fields of ``CompileOptions`` (``pp=2, microbatches=4, ...``).
    """
    options, measured = measure_defaults(CompileOptions(model=Path(model), **options))
    plan, _ = _compile(options)
    return with_basis(plan, measured.basis)


def emit(plan: Plan, out_dir: str | Path) -> Path:
    """Write the output directory of ``plan``; the model file is captured again from the plan's provenance."""
    out_dir = Path(out_dir)
    check_output_directory(out_dir)
    spec = load_model_file(plan.provenance.model_file)
    if spec.source_sha256 != plan.provenance.model_sha256:
        raise PlanError(f"{spec.path} changed since this plan was compiled; compile it again")
    graph = _capture(
        spec, plan.mesh["tp"], batch_size=plan.schedule.micro_batch_size, method=plan.provenance.capture,
        leaves=plan.provenance.leaves,
    )  # fmt: skip
    cost_model = get_cost_model("cpu")
    op_graph = annotate(graph, spec, cost_model, micro_batch_size=plan.schedule.micro_batch_size, dtype=plan.dtype)
    return emit_directory(plan, op_graph, spec, out_dir)


def compile_to_directory(options: CompileOptions, out_dir: Path, *, progress=None, console=None) -> tuple[Plan, Path]:
    """What ``autopart compile`` does: measure what the defaults need, compile, then emit, with
    one capture. ``progress(what, done, total)`` hears how the search goes; ``console`` shows
    the measuring."""
    check_output_directory(out_dir)
    options, measured = measure_defaults(options, console=console)
    plan, front = _compile(options, progress)
    if options.profile_pipeline:
        plan, front = _profiled_in_place(options, plan, front, progress)
    plan = with_basis(plan, measured.basis)
    return plan, emit_directory(plan, front.op_graph, front.spec, out_dir)


PROFILE_PIPELINE_ROUNDS = 3


def _profiled_in_place(options: CompileOptions, plan: Plan, front: _Front, progress) -> tuple[Plan, _Front]:
    """``plan`` once its pipeline's compute factor is measured (`autopart.profile_pipeline`): run,
    store, compile again, until the plan compiled is one whose pipeline was run (the factor can
    move the search to another mesh), at most `PROFILE_PIPELINE_ROUNDS` runs."""
    for _ in range(PROFILE_PIPELINE_ROUNDS):
        if plan.predicted.compute_factor_from == "pipeline":
            break
        database = front.cost_model.database
        with tempfile.TemporaryDirectory(prefix="autopart-profile-pipeline-") as folder:
            out = emit_directory(plan, front.op_graph, front.spec, Path(folder) / "out")
            profiled = profile_pipeline(out, plan, front.cost_model.runtime_overheads,
                                        cores=front.cost_model.device.cores)
        database.put_pipeline(front.cost_model.device.name, profiled.key, profiled.measured)
        database.save()
        plan, front = _compile(options, progress)
    return plan, front
