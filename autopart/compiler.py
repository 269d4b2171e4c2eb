"""The driver: the passes in order, from a model file to a Plan and an output directory.

    load -> capture -> annotate -> blocks -> solve -> (simulate) -> Plan -> emit

``compile(...)`` and ``emit(...)`` are the Python API; the command line builds the same
``CompileOptions`` and calls the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

import autopart
from autopart.annotate import OpGraph, annotate
from autopart.blocks import BlockChain, build_blocks
from autopart.capture import ModelSpec, capture, is_meta, load_model_file
from autopart.codegen.emit import check_output_directory, emit_directory
from autopart.codegen.stages import stage_boundaries
from autopart.errors import ConfigError, PlanError
from autopart.plan import Plan, Predicted, Provenance, ScheduleSpec, StagePlan, load_plan
from autopart.predict import simulate_pipeline
from autopart.runtime.materialise import check_initialisers
from autopart.runtime.optim import OPTIMIZERS
from autopart.schedule import SCHEDULE_KINDS, stage_rank
from autopart.solver.pipeline import PipelineProblem, evaluate, solve_cuts, stage_ranges
from cost_models import CostModel, get_cost_model, model_state_bytes

__all__ = ["CompileOptions", "compile", "emit", "compile_to_directory"]


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """Everything ``autopart compile`` takes; shared by the command line and the Python API."""

    model: Path
    """The model file (see the model-file contract)."""
    pp: int = 1
    """Pipeline stages (one rank each)."""
    microbatches: int | None = None
    """Microbatches per step; by default twice the stages, or global batch / micro-batch size."""
    micro_batch_size: int | None = None
    """Samples per microbatch; the other way to fix the microbatch count."""
    global_batch_size: int | None = None
    """Samples per training step; by default microbatches x micro-batch size, or 8."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved or zb-h1."""
    chunks: int = 1
    """Model chunks per rank (interleaved schedule)."""
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
    capture: str | None = None
    """How to capture the model: "fx" or "export"; by default fx, and export when fx fails."""
    leaf: tuple[str, ...] = ()
    """Module classes kept whole by tracing (``call_module`` nodes); each stage builds its own."""

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ConfigError(f"--pp must be at least 1, got {self.pp}")
        if self.schedule not in SCHEDULE_KINDS:
            raise ConfigError(f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULE_KINDS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        if self.chunks < 1 or (self.chunks > 1 and self.schedule != "interleaved"):
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

    def batch_shape(self) -> tuple[int, int, int]:
        """(global batch, microbatches, micro-batch size), filled in and checked."""
        m, b, total = self.microbatches, self.micro_batch_size, self.global_batch_size
        if total is None:
            total = m * b if m is not None and b is not None else 8
        if m is None and b is None:
            m = max(d for d in range(1, 2 * self.pp + 1) if total % d == 0)
        if m is None:
            m = total // b if total % b == 0 else 0
        if b is None:
            b = total // m if total % m == 0 else 0
        if m * b != total:
            raise ConfigError(
                f"the global batch ({total}) is not a whole number of microbatches; choose --global-batch-size, "
                "--microbatches and --micro-batch-size so that microbatches x micro-batch size = global batch"
            )
        if self.schedule == "interleaved" and m % self.pp:
            raise ConfigError(
                f"interleaved needs microbatches ({m}) to be a multiple of the pipeline degree ({self.pp}); "
                f"use --microbatches {self.pp * -(-m // self.pp)}"
            )
        return total, m, b


@dataclass(frozen=True, kw_only=True)
class _Front:
    """What the front passes give: kept so that emitting needs no second capture."""

    spec: ModelSpec
    op_graph: OpGraph
    chain: BlockChain
    cost_model: CostModel = field(repr=False)


def _front(options: CompileOptions, micro_batch_size: int) -> _Front:
    cost_model = get_cost_model(options.device)  # a bad device spec fails before the slow passes
    spec = load_model_file(options.model)
    if is_meta(spec.module):  # each rank will make its own weights: every module needs an initialiser
        check_initialisers(spec.module, spec.init_weights, spec.path.name)
    graph = capture(spec, batch_size=micro_batch_size, method=options.capture, leaves=options.leaf)
    op_graph = annotate(graph, spec, cost_model, micro_batch_size=micro_batch_size)
    return _Front(spec=spec, op_graph=op_graph, chain=build_blocks(op_graph), cost_model=cost_model)


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
    return PipelineProblem(
        block_time_s=tuple(b.forward_s + b.backward_s for b in chain.blocks),
        block_activation_bytes=tuple(b.saved_bytes for b in chain.blocks),
        boundary_transfer_s=tuple(cost_model.p2p_time(boundary.nbytes) for boundary in chain.boundaries),
        parameter_state_bytes={
            name: model_state_bytes(nbytes, optimizer=options.optimizer) for name, nbytes in chain.parameter_bytes.items()
        },
        block_parameters=tuple(b.parameters for b in chain.blocks),
        stages=stages,
        microbatches=microbatches,
        in_flight=_in_flight(options.schedule, options.pp, microbatches, options.chunks),
        memory_limit_bytes=memory,
        overhead_bytes=device.framework_overhead_bytes,
        stage_rank=tuple(stage_rank(s, options.pp) for s in range(stages)),
    )


def _plan_from_cuts(
    options: CompileOptions,
    front: _Front,
    problem: PipelineProblem,
    cuts: tuple[int, ...],
    batch: tuple[int, int, int],
    solver: tuple[str, float, float],
) -> Plan:
    chain = front.chain
    evaluation = evaluate(problem, cuts)
    ranges = stage_ranges(cuts, len(chain.blocks))
    stage_nodes = [tuple(n for k in r for n in chain.blocks[k].nodes) for r in ranges]
    sends = stage_boundaries(front.op_graph, stage_nodes)
    metas = {name: cost.output for name, cost in front.op_graph.nodes.items()}
    graph_inputs = front.op_graph.graph.input_names
    holders: dict[str, list[int]] = {}
    stages = []
    for s, r in enumerate(ranges):
        blocks = [chain.blocks[k] for k in r]
        parameters = tuple(dict.fromkeys(p for b in blocks for p in b.parameters))
        for p in parameters:
            holders.setdefault(p, []).append(s)
        needed = _batch_inputs(front.op_graph, stage_nodes[s], graph_inputs)
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
                forward_s=sum(b.forward_s for b in blocks),
                backward_s=sum(b.backward_s for b in blocks),
                backward_weight_s=sum(b.backward_weight_s for b in blocks),
                parameter_bytes=sum(chain.parameter_bytes[p] for p in parameters),
                activation_bytes=sum(b.saved_bytes for b in blocks),
            )
        )
    transfer = tuple(front.cost_model.p2p_time(sum(m.nbytes for _, m in st.outputs)) for st in stages[:-1])
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
    status, bound, gap = solver
    return Plan(
        mesh={"pp": options.pp, "tp": 1, "dp": 1},
        stages=tuple(stages),
        schedule=ScheduleSpec(
            kind=options.schedule,
            microbatches=microbatches,
            micro_batch_size=micro_batch_size,
            global_batch_size=total,
            chunks=options.chunks,
        ),
        predicted=Predicted(
            step_s=timeline.step_s,
            bubble=timeline.bubble,
            memory_bytes=evaluation.rank_memory_bytes,
            p2p_bytes_per_step=2 * microbatches * sum(sum(m.nbytes for _, m in st.outputs) for st in stages),
            stage_time_s=evaluation.stage_time_s,
            transfer_s=transfer,
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
        graph_inputs=graph_inputs,
        optimizer=options.optimizer,
        tied_parameters={p: tuple(s) for p, s in holders.items() if len(s) > 1},
    )


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


def _compile(options: CompileOptions) -> tuple[Plan, _Front]:
    batch = options.batch_shape()
    front = _front(options, batch[2])
    problem = _problem(options, front, batch[1])
    if options.plan is not None:
        return _pinned_plan(options, front, problem, batch), front
    solution = solve_cuts(problem, time_limit_s=options.time_limit_s)
    status = solution.status if problem.stages > 1 else "trivial"
    plan = _plan_from_cuts(
        options, front, problem, solution.evaluation.cuts, batch, (status, solution.bound_s, solution.gap)
    )
    return plan, front


def _pinned_plan(options: CompileOptions, front: _Front, problem: PipelineProblem, batch) -> Plan:
    """A hand-written or earlier plan: checked against this model, re-predicted, not re-solved."""
    plan = load_plan(options.plan)
    if plan.provenance.model_sha256 != front.spec.source_sha256:
        raise PlanError(
            f"{options.plan} was compiled from another version of {front.spec.path.name} "
            "(its model hash differs); recompile without --plan"
        )
    first_node = {n: k for k, b in enumerate(front.chain.blocks) for n in b.nodes}
    cuts = []
    for stage in plan.stages[:-1]:
        if not stage.nodes or stage.nodes[-1] not in first_node:
            raise PlanError(f"plan stage {stage.index} does not end on a block of this model; recompile")
        cuts.append(first_node[stage.nodes[-1]])
    pinned = CompileOptions(**{**options.__dict__, "pp": plan.mesh["pp"], "schedule": plan.schedule.kind, "chunks": plan.schedule.chunks})
    return _plan_from_cuts(pinned, front, problem, tuple(cuts), batch, ("pinned", 0.0, 0.0))


def compile(model: str | Path, **options) -> Plan:  # noqa: A001 - the API's verb
    """Compile ``model`` (a model file) into a Plan; ``emit(plan, out_dir)`` writes its programs.

    Keyword options are the fields of ``CompileOptions`` (``pp=2, microbatches=4, ...``).
    """
    plan, _ = _compile(CompileOptions(model=Path(model), **options))
    return plan


def emit(plan: Plan, out_dir: str | Path) -> Path:
    """Write the output directory of ``plan``; the model file is captured again from the plan's provenance."""
    out_dir = Path(out_dir)
    check_output_directory(out_dir)
    spec = load_model_file(plan.provenance.model_file)
    if spec.source_sha256 != plan.provenance.model_sha256:
        raise PlanError(f"{spec.path} changed since this plan was compiled; compile it again")
    method = plan.provenance.capture
    graph = capture(spec, batch_size=plan.schedule.micro_batch_size, method=method, leaves=plan.provenance.leaves)
    cost_model = get_cost_model("cpu")
    op_graph = annotate(graph, spec, cost_model, micro_batch_size=plan.schedule.micro_batch_size)
    return emit_directory(plan, op_graph, spec, out_dir)


def compile_to_directory(options: CompileOptions, out_dir: Path) -> tuple[Plan, Path]:
    """What ``autopart compile`` does: compile, then emit, with one capture."""
    check_output_directory(out_dir)
    plan, front = _compile(options)
    return plan, emit_directory(plan, front.op_graph, front.spec, out_dir)
