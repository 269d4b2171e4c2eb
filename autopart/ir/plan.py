"""The Plan: the single source of truth between the solver, the emitter and the runtime.

A plan is plain data, saved as versioned JSON (``plan.json``). A plan written or edited by hand
is the same type: ``autopart compile --plan plan.json`` skips the solver and emits it.
Nothing here is unpickled: ``Plan.from_json`` checks every field and raises ``PlanError`` with
the path of the field that is wrong.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from autopart.ir.tensors import DTYPES, TensorMeta
from autopart.ir.errors import PlanError, read_user_file
from autopart.ir.recompute import RECOMPUTE_MODES

__all__ = ["PLAN_VERSION", "StagePlan", "ScheduleSpec", "Predicted", "Provenance", "Plan", "load_plan",
           "plan_files_read_once", "gradient_boundaries", "takes_gradient"]

PLAN_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage: the compute nodes it runs and what it exchanges with its neighbours."""

    index: int
    rank: int  # pipeline rank that runs it
    blocks: tuple[int, int]  # first and last block, inclusive
    nodes: tuple[str, ...]  # compute nodes, in graph order
    inputs: tuple[tuple[str, TensorMeta], ...]  # received from the previous stage, one microbatch
    outputs: tuple[tuple[str, TensorMeta], ...]  # sent to the next stage (empty on the last stage)
    batch_inputs: tuple[str, ...]  # graph inputs this stage reads from the batch
    parameters: tuple[str, ...]
    forward_s: float
    backward_s: float
    backward_weight_s: float
    parameter_bytes: int  # the whole stage, before tensor-parallel sharding
    activation_bytes: int  # saved for backward, one microbatch, one rank
    strategies: dict[str, str] = field(default_factory=dict)  # node -> tensor-parallel strategy, when not replicated
    overlapped: dict[str, int] = field(default_factory=dict)  # linear -> the pieces it runs in (--tp-overlap)
    parameter_placements: dict[str, str] = field(default_factory=dict)  # parameter -> placement, when sharded
    recompute: str = "none"  # none | selective | full (autopart.passes.recompute); backward_s includes its recompute
    no_grad_inputs: tuple[str, ...] = ()
    """The received tensors that need no gradient (no trainable parameter before them,
    `autopart.passes.grad_flow`): the stage makes them no leaf of autograd and sends no gradient
    back for them; every other floating one takes one. Written only where there are some."""


def takes_gradient(tensors: tuple[tuple[str, TensorMeta], ...], no_grad_inputs: tuple[str, ...]) -> list[bool]:
    """Per tensor crossing a boundary (a stage's ``inputs``, or its ``outputs`` with the next
    stage's ``no_grad_inputs``), whether a gradient goes back for it: a floating one that needs one."""
    return [meta.dtype.startswith(("float", "bfloat", "complex")) and name not in no_grad_inputs
            for name, meta in tensors]


def gradient_boundaries(stages: Sequence[StagePlan]) -> tuple[bool, ...]:
    """Per boundary between ``stages``, whether a gradient comes back across it (`takes_gradient`)."""
    return tuple(any(takes_gradient(before.outputs, after.no_grad_inputs)) for before, after in zip(stages, stages[1:]))


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    kind: str  # gpipe | 1f1b | interleaved | zb-h1 | zbv
    microbatches: int
    micro_batch_size: int
    global_batch_size: int
    chunks: int = 1
    actions: tuple[tuple[str, ...], ...] = ()
    """Per pipeline rank, its compute actions in the order it runs them, in torch's action strings
    ("0F0", "1I3", "1W3"): what the runtime executes, validated when a plan is loaded to run
    (`autopart.schedule.stored`); the sends and receives are added from them. Empty in a plan
    written before the lists were stored: the runtime then runs the kind's generated order."""


@dataclass(frozen=True, kw_only=True)
class Predicted:
    step_s: float
    bubble: float
    memory_bytes: tuple[int, ...]  # per pipeline rank
    p2p_bytes_per_step: int
    stage_time_s: tuple[float, ...]  # forward + backward + transfers of one microbatch, per stage
    transfer_s: tuple[float, ...]  # one way, one microbatch, per boundary between stages
    pipeline_s: float = 0.0  # the schedule alone (the trace's span); step_s adds the runtime's costs
    collective_s: tuple[tuple[float, float], ...] = ()  # per stage, what its data-parallel collectives add
    # to each forward and each backward (ZeRO-2/3's gathers and reduce-scatters): inside pipeline_s and
    # the trace's actions, beside the stages' own times; () for none
    rank_tail_s: tuple[float, ...] = ()  # per rank, after the pipeline: tied gradients, optimizer step
    reduction_s: tuple[tuple[float, float], ...] = ()  # per rank, what the data-parallel all-reduce adds:
    # (the compute's delay by its work on shared cores, the wait past the rank's last action)
    compute_factor: tuple[float, ...] = ()  # per stage: inside the pipeline each forward and backward takes this many
    # times its profiled time (stage_time_s and the stages' times are the profiled ones); () for 1
    compute_factor_from: str = "none"  # "pipeline" (measured in it: --profile-pipeline), "co-run" (the model
    # timed beside the host's other ranks), "device" or "none"
    profiled_step_s: float | None = None  # the median step this very plan took when --profile-pipeline ran it
    background_load: float = 0.0  # other busy processes at compile time that step_s counts (beyond those beside a measured pipeline)
    model_flops_per_step: float = 0.0  # forward and backward of the whole model over the global batch, no recompute
    peak_flops: float = 0.0  # one device's dense peak FLOP/s in the plan's precision (its spec): MFU's denominator
    basis: str = ""  # what step_s rests on ("ops and messages measured on this machine", "h100-sxm roofline")
    basis_key: str = ""  # that basis's key in autopart/predict/accuracy.json ("cpu-measured", "spec-roofline")
    error_median: float | None = None  # the band the benchmark of that basis measured: median |error| ...
    error_worst: float | None = None  # ... and worst |error| (fractions); None where none was measured
    error_benchmark: str = ""  # the benchmark that measured the band ("cost_accuracy", "published_runs"); with
    # no band, why none holds where one was measured for other layouts ("cost_accuracy's rows ran pp plans alone")
    # where the step the models gave implies more than the ~55% MFU that dense 16-bit training
    # reaches at best (`autopart.predict.accuracy.MFU_CEILING`), step_s is the ceiling's and this theirs
    unbounded_step_s: float | None = None

    @property
    def modelled_step_s(self) -> float:
        """The step the models gave, beneath any ceiling: what the search ranks plans by, since
        plans that one ceiling bounds alike still differ in what they would take."""
        return self.step_s if self.unbounded_step_s is None else self.unbounded_step_s


@dataclass(frozen=True, kw_only=True)
class Provenance:
    model_file: str
    model_sha256: str
    capture: str
    cost_model: str
    solver_status: str  # optimal | feasible | pinned (from --plan) | trivial (one stage)
    objective_s: float
    bound_s: float
    gap: float
    autopart_version: str
    torch_version: str
    leaves: tuple[str, ...] = ()  # module classes kept whole by tracing (--leaf)
    device: str = ""  # the device spec costed for: a bundled name or a .toml's absolute path ("" in older plans)
    device_kind: str = ""  # that spec's kind: "cpu", "cuda", "rocm" ("" in older plans)
    search: dict[str, Any] = field(default_factory=dict)  # what the search visited, and its finalists
    sources_sha256: str = ""  # the model file's and the files' beside it that it imports ("" in older plans)

    @property
    def measured_sha256(self) -> str:
        """The hash that measurements of the model are kept under (`ModelSpec.sources_sha256`)."""
        return self.sources_sha256 or self.model_sha256


@dataclass(frozen=True, kw_only=True)
class Plan:
    mesh: dict[str, int]  # {"pp": P, "tp": 1, "dp": 1}
    stages: tuple[StagePlan, ...]
    schedule: ScheduleSpec
    predicted: Predicted
    provenance: Provenance
    zero: int = 0
    """What is sharded over the data-parallel group: 0 nothing, 1 the optimizer state (ZeRO-1),
    2 the gradients too (FSDP, a stage's parameters gathered once a step), 3 the parameters too
    (FSDP, a stage's parameters gathered for each forward and again for each backward)."""
    sp: bool = False  # sequence parallelism: TP's residual stream split over the sequence (autopart.solve.sequence)
    tp_overlap: bool = False  # the sequence-parallel collectives overlapped with their linears (autopart.runtime.overlapped)
    graph_inputs: tuple[str, ...] = ()  # the model's inputs in call order, then "target" when there is a loss_fn
    optimizer: str = "adamw"
    tied_parameters: dict[str, tuple[int, ...]] = field(default_factory=dict)  # parameter -> stages holding it
    dtype: str = "fp32"  # autopart.ir.tensors.DTYPES: fp32, bf16 (bf16 working weights, fp32 masters), bf16-autocast
    embedding_parameters: tuple[str, ...] = ()  # weights of embedding modules, every alias: never weight-decayed
    gpus_per_node: int | None = None
    """The ranks of a node that the plan was costed for (``--gpus-per-node``), which fill nodes in
    order: what the printed torchrun commands start on each node. None in plans written before."""
    batch_statistics: tuple[str, ...] = ()
    """The ops that normalise by their batch's statistics (BatchNorm in training): a part of the
    batch trains them otherwise than the whole does, so the reference splits it as the plan does."""
    version: int = PLAN_VERSION
    stage_sha256: dict[str, str] = field(default_factory=dict, compare=False)
    """The sha256 of every stage file the compile wrote ("stages/stage_0.py": ...), which each rank
    checks before it runs one; set at emit, so two plans that decide the same compare equal."""

    @property
    def world_size(self) -> int:
        return self.mesh["pp"] * self.mesh["tp"] * self.mesh["dp"]

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON values (lists, dicts, numbers, strings)."""
        # the action lists (a million strings in a long pipeline) as they are: asdict would copy each
        data = asdict(replace(self, schedule=replace(self.schedule, actions=())))
        data["schedule"]["actions"] = [list(actions) for actions in self.schedule.actions]
        for written, stage in zip(data["stages"], self.stages):  # a tensor as TensorMeta writes it (no null split)
            written["inputs"], written["outputs"] = ([[n, m.to_json()] for n, m in tensors]
                                                     for tensors in (stage.inputs, stage.outputs))
            if not stage.no_grad_inputs:
                del written["no_grad_inputs"]
        return json.loads(json.dumps(data))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @staticmethod
    def from_json(data: Any) -> Plan:
        reader = _Reader(data, "plan")
        version = reader.int("version")
        if version != PLAN_VERSION:
            raise PlanError(f"plan version {version} is not supported (this autopart reads version {PLAN_VERSION})")
        mesh = reader.sub("mesh")
        schedule = reader.sub("schedule")
        predicted = reader.sub("predicted")
        provenance = reader.sub("provenance")
        stages = tuple(_read_stage(s, i) for i, s in enumerate(reader.list("stages")))
        if not stages:
            raise PlanError("plan.stages is empty; a plan needs at least one stage")
        for key in ("pp", "tp", "dp"):
            mesh.positive(key)
        for key in ("microbatches", "micro_batch_size", "global_batch_size", "chunks"):
            schedule.positive(key)
        if len(stages) != mesh.data["pp"] * schedule.data["chunks"]:
            raise PlanError(f"plan.stages lists {len(stages)} stages but plan.mesh.pp x plan.schedule.chunks is "
                            f"{mesh.data['pp']} x {schedule.data['chunks']}; fix the field or recompile with autopart compile")
        _check_stages(stages, mesh.data["pp"])
        _check_boundaries(stages, mesh.data["tp"])
        return Plan(
            version=version,
            mesh={k: mesh.int(k) for k in ("pp", "tp", "dp")},
            stages=stages,
            schedule=_read_schedule(schedule),
            predicted=_read_predicted(predicted),
            provenance=Provenance(
                **{k: provenance.str(k) for k in ("model_file", "model_sha256", "capture", "cost_model")},
                solver_status=provenance.str("solver_status"),
                **{k: provenance.float(k) for k in ("objective_s", "bound_s", "gap")},
                autopart_version=provenance.str("autopart_version"),
                torch_version=provenance.str("torch_version"),
                leaves=tuple(str(n) for n in provenance.data.get("leaves", [])),
                device=provenance.str("device") if "device" in provenance.data else "",
                device_kind=provenance.str("device_kind") if "device_kind" in provenance.data else "",
                search=provenance.sub("search").data if "search" in provenance.data else {},
                sources_sha256=provenance.str("sources_sha256") if "sources_sha256" in provenance.data else "",
            ),
            zero=reader.zero_level("zero"),
            sp=reader.bool("sp") if "sp" in reader.data else False,  # plans written before it had none
            tp_overlap=reader.bool("tp_overlap") if "tp_overlap" in reader.data else False,
            graph_inputs=tuple(str(n) for n in reader.list("graph_inputs")),
            optimizer=reader.str("optimizer"),
            tied_parameters={
                str(k): tuple(int(s) for s in v) for k, v in reader.sub("tied_parameters").data.items()
            },
            dtype=reader.choice("dtype", DTYPES, default="fp32"),
            embedding_parameters=tuple(str(n) for n in reader.data.get("embedding_parameters", [])),
            gpus_per_node=reader.positive("gpus_per_node") if reader.data.get("gpus_per_node") is not None else None,
            batch_statistics=tuple(str(n) for n in reader.data.get("batch_statistics", [])),
            stage_sha256={str(k): str(v) for k, v in reader.sub("stage_sha256").data.items()}
            if "stage_sha256" in reader.data else {},
        )


def _check_boundaries(stages: tuple[StagePlan, ...], tp: int) -> None:
    """What a stage sends is what the next receives, and a tensor held split divides ``tp`` ways:
    a receiver sizes its buffers by its own list, so a mismatch would read the wrong bytes."""
    for position, stage in enumerate(stages):
        if position + 1 < len(stages) and stage.outputs != stages[position + 1].inputs:
            raise PlanError(f"plan.stages[{position}].outputs differ from plan.stages[{position + 1}].inputs; "
                            "each stage receives what the one before it sends: recompile")
        unknown = set(stage.no_grad_inputs) - {name for name, _ in stage.inputs}
        if unknown:
            raise PlanError(f"plan.stages[{position}].no_grad_inputs names {sorted(unknown)}, which the stage does not "
                            "receive; list only its inputs, or recompile")
        for name, meta in (*stage.inputs, *stage.outputs):
            if meta.split_dim is not None and meta.shape[meta.split_dim] % tp:
                raise PlanError(f"plan.stages[{position}] holds {name!r} split {tp} ways along dim {meta.split_dim}, "
                                f"which its shape {list(meta.shape)} does not divide; recompile")


def _check_stages(stages: tuple[StagePlan, ...], pp: int) -> None:
    """Each stage numbered by its place in the list, on a pipeline rank below ``pp``, over blocks [first, last]."""
    for position, stage in enumerate(stages):
        where = f"plan.stages[{position}]"
        if stage.index != position:
            raise PlanError(f"{where}.index is {stage.index} but the stage is number {position} in the list; "
                            "stages are listed in order")
        if not 0 <= stage.rank < pp:
            raise PlanError(f"{where}.rank is {stage.rank} but plan.mesh.pp is {pp}: pipeline ranks "
                            f"run from 0 to {pp - 1}; fix the field or recompile with autopart compile")
        if len(stage.blocks) != 2 or not 0 <= stage.blocks[0] <= stage.blocks[1]:
            raise PlanError(f"{where}.blocks must be [first, last] with 0 <= first <= last, got "
                            f"{list(stage.blocks)}")


def _read_predicted(predicted: _Reader) -> Predicted:
    return Predicted(
        step_s=predicted.float("step_s"),
        bubble=predicted.float("bubble"),
        memory_bytes=tuple(int(v) for v in predicted.list("memory_bytes")),
        p2p_bytes_per_step=predicted.int("p2p_bytes_per_step"),
        stage_time_s=tuple(float(v) for v in predicted.list("stage_time_s")),
        transfer_s=tuple(float(v) for v in predicted.list("transfer_s")),
        pipeline_s=predicted.float("pipeline_s") if "pipeline_s" in predicted.data else 0.0,
        collective_s=tuple((float(f), float(b)) for f, b in predicted.data.get("collective_s", ())),
        rank_tail_s=tuple(float(v) for v in predicted.data.get("rank_tail_s", ())),
        reduction_s=tuple((float(d), float(w)) for d, w in predicted.data.get("reduction_s", ())),
        compute_factor=tuple(float(v) for v in predicted.data.get("compute_factor", ())),
        compute_factor_from=str(predicted.data.get("compute_factor_from", "none")),
        profiled_step_s=None if predicted.data.get("profiled_step_s") is None
        else float(predicted.data["profiled_step_s"]),
        background_load=float(predicted.data.get("background_load", 0.0)),
        model_flops_per_step=float(predicted.data.get("model_flops_per_step", 0.0)),
        peak_flops=float(predicted.data.get("peak_flops", 0.0)),
        basis=str(predicted.data.get("basis", "")),
        basis_key=str(predicted.data.get("basis_key", "")),
        error_median=_optional_float(predicted.data.get("error_median")),
        error_worst=_optional_float(predicted.data.get("error_worst")),
        error_benchmark=str(predicted.data.get("error_benchmark", "")),
        unbounded_step_s=_optional_float(predicted.data.get("unbounded_step_s")),
    )


def _read_stage(data: Any, index: int) -> StagePlan:
    reader = _Reader(data, f"plan.stages[{index}]")
    return StagePlan(
        index=reader.int("index"),
        rank=reader.int("rank"),
        blocks=tuple(int(b) for b in reader.list("blocks")),  # type: ignore[arg-type]
        nodes=tuple(str(n) for n in reader.list("nodes")),
        inputs=tuple(_read_tensor(t) for t in reader.list("inputs")),
        outputs=tuple(_read_tensor(t) for t in reader.list("outputs")),
        batch_inputs=tuple(str(n) for n in reader.list("batch_inputs")),
        parameters=tuple(str(n) for n in reader.list("parameters")),
        forward_s=reader.float("forward_s"),
        backward_s=reader.float("backward_s"),
        backward_weight_s=reader.float("backward_weight_s"),
        parameter_bytes=reader.int("parameter_bytes"),
        activation_bytes=reader.int("activation_bytes"),
        strategies={str(k): str(v) for k, v in reader.sub("strategies").data.items()},
        overlapped=_read_pieces(reader.sub("overlapped")) if "overlapped" in reader.data else {},
        parameter_placements={str(k): str(v) for k, v in reader.sub("parameter_placements").data.items()},
        recompute=reader.choice("recompute", RECOMPUTE_MODES, default="none"),
        no_grad_inputs=tuple(str(n) for n in reader.data.get("no_grad_inputs", ())),
    )


def _read_pieces(overlapped: _Reader) -> dict[str, int]:
    pieces = {str(name): overlapped.positive(name) for name in overlapped.data}
    for name, count in pieces.items():
        if count < 2:
            raise PlanError(f"{overlapped.where}.{name} must be at least 2 (pieces of an overlapped linear), got {count}")
    return pieces


def _read_schedule(schedule: _Reader) -> ScheduleSpec:
    return ScheduleSpec(
        kind=schedule.str("kind"),
        microbatches=schedule.int("microbatches"),
        micro_batch_size=schedule.int("micro_batch_size"),
        global_batch_size=schedule.int("global_batch_size"),
        chunks=schedule.int("chunks"),
        actions=_read_actions(schedule),
    )


def _read_actions(schedule: _Reader) -> tuple[tuple[str, ...], ...]:
    """The per-rank action strings as written; what they mean is checked where they are run."""
    if "actions" not in schedule.data:
        return ()
    lists = schedule.list("actions")
    for rank, actions in enumerate(lists):
        if not (isinstance(actions, list) and all(isinstance(a, str) for a in actions)):
            raise PlanError(f"plan.schedule.actions[{rank}] must be a list of action strings such as \"0F1\", "
                            f"got {json.dumps(actions)[:60]}")
    return tuple(tuple(actions) for actions in lists)


def _read_tensor(data: Any) -> tuple[str, TensorMeta]:
    if not (isinstance(data, list) and len(data) == 2 and isinstance(data[0], str) and isinstance(data[1], dict)):
        raise PlanError(f"a stage tensor must be [name, {{shape, dtype}}], got {json.dumps(data)[:80]}")
    try:
        meta = TensorMeta.from_json(data[1])
    except (KeyError, TypeError, ValueError):
        raise PlanError(f"stage tensor {data[0]!r} has a malformed shape or dtype") from None
    if meta.split_dim is not None and not 0 <= meta.split_dim < len(meta.shape):
        raise PlanError(f"stage tensor {data[0]!r} is split along dim {meta.split_dim}, which its shape "
                        f"{list(meta.shape)} lacks; recompile")
    return data[0], meta


class _Reader:
    """Typed access to one JSON object, with errors that name the field."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise PlanError(f"{where} must be a JSON object, got {type(data).__name__}")
        self.data, self.where = data, where

    def _get(self, key: str, kinds: tuple[type, ...], what: str) -> Any:
        if key not in self.data:
            raise PlanError(f"{self.where}.{key} is missing; the plan is incomplete (recompile, or add the field)")
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise PlanError(f"{self.where}.{key} must be {what}, got {json.dumps(value)[:60]}")
        return value

    def int(self, key: str) -> int:
        return self._get(key, (int,), "an integer")

    def positive(self, key: str) -> int:
        value = self.int(key)
        if value < 1:
            raise PlanError(f"{self.where}.{key} must be at least 1, got {value}")
        return value

    def float(self, key: str) -> float:
        return float(self._get(key, (int, float), "a number"))

    def bool(self, key: str) -> bool:
        value = self.data.get(key)
        if not isinstance(value, bool):
            raise PlanError(f"{self.where}.{key} must be true or false, got {json.dumps(value)[:60]}")
        return value

    def zero_level(self, key: str) -> int:
        """0 to 3; plans written when only ZeRO-1 existed say true or false."""
        value = self.data.get(key)
        if isinstance(value, bool):
            return int(value)
        if not isinstance(value, int) or not 0 <= value <= 3:
            raise PlanError(f"{self.where}.{key} must be 0, 1, 2 or 3 (the ZeRO level), got {json.dumps(value)[:60]}")
        return value

    def str(self, key: str) -> str:
        return self._get(key, (str,), "a string")

    def choice(self, key: str, allowed: tuple[str, ...], *, default: str) -> str:
        """One of ``allowed``; ``default`` when the field is absent (plans written before it existed)."""
        if key not in self.data:
            return default
        value = self.data[key]
        if value not in allowed:
            raise PlanError(f"{self.where}.{key} must be one of {', '.join(allowed)}, got {json.dumps(value)[:60]}")
        return value

    def list(self, key: str) -> list[Any]:
        return self._get(key, (list,), "a list")

    def sub(self, key: str) -> _Reader:
        return _Reader(self._get(key, (dict,), "an object"), f"{self.where}.{key}")


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


_read_once: dict[tuple[Path, int, int], bytes] | None = None
"""The plan files read while `plan_files_read_once` holds, by path and the stat that read them."""


@contextlib.contextmanager
def plan_files_read_once() -> Iterator[None]:
    """Each plan file read once while this holds (one compile): its options and their copies, the
    check of its model and its rebuild each ask for the plan of ``--plan``. A file written since
    (another size or time) is read again."""
    global _read_once
    if _read_once is not None:  # within a compile already
        yield
        return
    _read_once = {}
    try:
        yield
    finally:
        _read_once = None


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    if not path.exists():
        raise PlanError(f"plan file '{path}' does not exist")
    stat = path.stat()
    key = (path.resolve(), stat.st_mtime_ns, stat.st_size)
    text = _read_once.get(key) if _read_once is not None else None
    if text is None:
        text = read_user_file(path, PlanError, "plan file", "give the plan.json that autopart compile wrote")
        if _read_once is not None:
            _read_once[key] = text
    try:
        data = json.loads(text.decode())
    except (ValueError, RecursionError) as exc:  # not JSON, not text, an integer of 5000 digits, nested past the parser
        raise PlanError(f"{path} is not valid JSON ({exc}); fix it or recompile to write a new plan") from None
    return Plan.from_json(data)
