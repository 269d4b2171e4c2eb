"""Profile a plan's stages where they run: inside their pipeline, on this machine.

A stage computes more slowly inside a running pipeline than alone in one process, where
``autopart profile`` times its ops: the other ranks compute beside it and share the caches and
the memory bus, the messages' threads run mid-compute, a rank that waited wakes on a cold core,
and with more ranks than cores each one refills what another evicted. The slowdown grows with
the ranks per core and with the size of the stage, so ``profile-comm``'s tiny layer understates
it for a real model (``docs/cost_accuracy.md`` has the figures).

`profile_pipeline` runs the compiled programs here for a few steps (``train.py
--action-times``), takes the time of every forward, backward and weight-gradient action of
every rank over the steps after the warm-up (wall time, or CPU time where the ranks outnumber
the cores: the step model shares the cores itself), less the runtime's fixed cost per action, and
divides it by what the plan counted for the same actions, per stage and for all stages: the
pipeline compute factors of this model on this mesh (per stage, since stages differ: the one
that holds the loss, say, runs slower against its profile than the first).
``autopart compile --profile-pipeline`` stores them in the cost database under `pipeline_key`
and compiles again; the step model then multiplies each forward and backward by its stage's
factor and, because that time already holds the waking and the refilling, adds neither.
The wall-clock part of sharing cores and waiting for messages stay the step model's.

It also measures the sum of tied gradients (GPT's embedding and head) at the end of each step:
the holders wait for each other there, so the one that comes last pays the all-reduce with the
others just woken, which takes longer than ``profile-comm`` measures between two busy
processes. Its wall time on that rank (median over the steps) replaces the all-reduces' model
in the tails of the plans of this pipeline; and so does each rank's optimizer step, which runs
slower than its profile (after the waits and the all-reduce, its state is colder still than
right after a backward, where ``autopart profile`` times it). Its messages,
paired on the host's clock, give the step model a send's time, a receive's once its data is
there and the rest of a waited one's delivery, in place of ``profile-comm``'s.

And it keeps how single steps moved from the median one (`PipelineMeasurement.step_variation`):
each action's time against its median, how late each message came, each rank's tail. A step
waits for its slowest rank and its latest message, and a busy machine's slow moments catch the
ranks at different times, so the median step is longer than the step of the median actions;
the step model replays the steps kept and takes their median. Not where the ranks outnumber the
cores: there a step moves mostly with which rank had a core when, which the step model's
sharing of the cores already holds (replaying it as well would count that twice).

It keeps the median step the run itself took too (`PipelineMeasurement.step_s`), of the plan it
ran: where the compile that follows keeps that plan, ``plan.json`` holds it beside the prediction
(``predicted.profiled_step_s``), the step model's error on the very steps it was built from.

It needs the plan's ranks on this host, on its CPU.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console

from autopart.codegen.emit import emit_directory
from autopart.passes.front import Front
from autopart.tools.local_run import LocalRunError, run_locally
from autopart.ir.plan import Plan
from autopart.profiling.span import span, timed_run
from autopart.runtime.mesh import Mesh
from autopart.schedule import RECEIVE_KINDS, SPLIT_BACKWARD_KINDS, Action, Kind
from cost_models.database import (
    VARIATION_STEPS,
    PipelineMeasurement,
    RuntimeOverheads,
    blocks_key,
    plan_shape,
    tail_key,
)

__all__ = ["PipelineProfile", "affordable", "pipeline_key", "plan_pipeline_key", "profile_pipeline", "profiled_in_place",
           "measure", "run_arguments"]

WARMUP_STEPS = 4  # left out: the first steps allocate, and fill the caches and the allocator
MEASURED_STEPS = 8  # at least; and at least
MEASURED_SECONDS = 8.0  # the run's steps together: this machine's speed moves within seconds
MAX_STEPS = 1000  # whatever the seconds: a plan of a millisecond a step has its fixed costs per step besides


def pipeline_key(model_sha256: str, mesh: dict[str, int], micro_batch_size: int, optimizer: str, *,
                 dtype: str, zero: int, recompute: tuple[str, ...], sp: bool = False, tp_overlap: bool = False,
                 capture: str = "fx", leaves: tuple[str, ...] = ()) -> str:
    """The cost database's key of one model's pipeline: its source and how it was captured, its
    mesh, microbatch size, optimizer, precision, ZeRO level, each stage's recompute and the
    tensor-parallel collectives' form (each changes what a stage computes, what it sends or its
    tail: a plan that differs in any of them was not run, and runs again, `profiled_in_place`).
    The schedule, microbatches and cuts are the measurement's ``step_of``."""
    return (f"pipeline(model={model_sha256[:16]}, capture={capture}, leaves={','.join(leaves)}, pp={mesh['pp']}, "
            f"tp={mesh['tp']}, dp={mesh['dp']}, micro_batch={micro_batch_size}, optimizer={optimizer}, dtype={dtype}, "
            f"zero={int(zero)}, recompute={'/'.join(recompute)}, sp={int(sp)}, tp_overlap={int(tp_overlap)})")


def plan_pipeline_key(plan: Plan) -> str:
    """`pipeline_key` of the pipeline ``plan`` runs."""
    return pipeline_key(plan.provenance.measured_sha256, plan.mesh, plan.schedule.micro_batch_size, plan.optimizer,
                        dtype=plan.dtype, zero=plan.zero, recompute=tuple(stage.recompute for stage in plan.stages),
                        sp=plan.sp, tp_overlap=plan.tp_overlap, capture=plan.provenance.capture,
                        leaves=plan.provenance.leaves)


@dataclass(frozen=True, kw_only=True)
class PipelineProfile:
    key: str
    measured: PipelineMeasurement  # what the cost database keeps
    compute_s: float  # seconds of the compute actions of all ranks, per step (median over the steps; see measure)
    predicted_s: float  # what the plan counts for them, before the factor
    steps: int


def action_seconds(plan: Plan, action: Action, overheads: RuntimeOverheads) -> tuple[float, float]:
    """(compute the plan counts, the runtime's fixed cost) of one compute action, as
    `autopart.predict.step_time.predicted_step_s` costs it before its factor."""
    stage = plan.stages[action.stage]
    forward, backward, weight = overheads.action_costs(recompute=stage.recompute != "none",
                                                       split=plan.schedule.kind in SPLIT_BACKWARD_KINDS)
    if action.kind is Kind.F:
        return stage.forward_s, forward
    if action.kind is Kind.W:
        return stage.backward_weight_s, weight
    if action.kind is Kind.I:
        return stage.backward_s - stage.backward_weight_s, backward - weight
    return stage.backward_s, backward


def measure(plan: Plan, action_times: Path, overheads: RuntimeOverheads, *, cores: int,
            warmup: int = WARMUP_STEPS) -> PipelineProfile:
    """The measurement from a run's ``--action-times`` folder (one ``rank_<r>.jsonl`` per rank),
    on a host of ``cores`` cores: with no more ranks than cores each compute action counts its
    wall time (a message's thread that takes the core mid-compute slows it too), with more its
    CPU time (the step model shares the cores itself)."""
    shared = plan.world_size > cores
    # (stage, step) -> seconds of its compute actions on every rank, less their fixed costs; and the plan's count
    measured: dict[tuple[int, int], float] = {}
    predicted: dict[tuple[int, int], float] = {}
    took_by_step: dict[tuple[int, str], float] = {}  # (step, compute action or send) -> seconds, its slowest copy's
    tied: dict[int, tuple[float, float]] = {}  # step -> (start on the host's clock, seconds) of the last holder's tied sums
    optimizer: dict[tuple[int, int], float] = {}  # (step, rank) -> seconds of its optimizer step
    ends: dict[int, float] = {}  # step -> seconds from a rank's start to its optimizer step's end, the slowest rank's
    messages: dict[tuple[int, int, int, str], tuple[float, float]] = {}  # (step, dp, tp, action) -> start, end
    holders = {stage.rank for stage in plan.stages if set(stage.parameters) & set(plan.tied_parameters)}
    mesh = Mesh.of(plan)
    files = sorted(action_times.glob("rank_*.jsonl"), key=lambda f: int(f.stem.split("_")[1]))
    if len(files) != plan.world_size:
        raise RuntimeError(f"{action_times} holds the action times of {len(files)} ranks, not {plan.world_size}")
    for rank, file in enumerate(files):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            step = record["step"]
            if step < warmup:
                continue
            where, origin = mesh.coordinates(rank), record["origin"]
            start, end, _cpu, tied_end, optimizer_start = record["tail"]
            start = record.get("reduced", start)  # the data-parallel wait is the step model's own (autopart.predict.reduction)
            if where.pp in holders and origin + start >= tied.get(step, (-math.inf, 0.0))[0]:
                tied[step] = (origin + start, tied_end - start)
            optimizer[step, rank] = end - optimizer_start
            ends[step] = max(end, ends.get(step, 0.0))
            for name, action_start, action_end, cpu_s in record["actions"]:
                action = Action.parse(name)
                took = cpu_s if shared and action.is_compute else action_end - action_start
                if action.kind not in RECEIVE_KINDS:  # a receive's time is mostly waiting: its delivery counts
                    took_by_step[step, name] = max(took, took_by_step.get((step, name), 0.0))
                if not action.is_compute:  # on the host's clock, to pair each receive with its send
                    messages[step, where.dp, where.tp, name] = (origin + action_start, origin + action_end)
                    continue
                compute, fixed = action_seconds(plan, action, overheads)
                measured[action.stage, step] = measured.get((action.stage, step), 0.0) + took - fixed
                predicted[action.stage, step] = predicted.get((action.stage, step), 0.0) + compute
    if not measured or min(predicted.values()) <= 0:
        raise RuntimeError(f"{action_times} holds no compute action after step {warmup}")
    steps = sorted({step for _, step in measured})
    # the same actions every step: the median step's ratio, of all stages and of each
    compute_s = statistics.median(sum(v for (_, t), v in measured.items() if t == step) for step in steps)
    predicted_s = statistics.median(sum(v for (_, t), v in predicted.items() if t == step) for step in steps)
    stage_factors = {
        blocks_key([stage.blocks]): statistics.median(measured[stage.index, t] for t in steps)
        / statistics.median(predicted[stage.index, t] for t in steps)
        for stage in plan.stages
    }
    tied_s = statistics.median(seconds for _, seconds in tied.values()) if tied else None
    optimizer_s: dict[str, float] = {}
    tails: dict[tuple[int, int], float] = {}  # (step, pipeline rank) -> its tail as the step model counts it
    for (step, rank), seconds in optimizer.items():
        pp = mesh.coordinates(rank).pp
        tails[step, pp] = max(tails.get((step, pp), 0.0), seconds + (tied[step][1] if pp in holders and tied else 0.0))
    for rank in range(plan.world_size):
        here = blocks_key([stage.blocks for stage in plan.stages if stage.rank == mesh.coordinates(rank).pp])
        optimizer_s[here] = max(optimizer_s.get(here, 0.0), statistics.median(optimizer[t, rank] for t in steps))
    # where the ranks outnumber the cores, a step moves mostly with which rank had a core when,
    # and the step model shares the cores itself: replaying the steps would count that twice
    step_variation = () if shared else _step_variation(steps, took_by_step, _deliveries(messages), tails)
    send_s, recv_s, transfer_s, waited_s = message_times(messages)
    return PipelineProfile(
        key=plan_pipeline_key(plan),
        measured=PipelineMeasurement(compute_factor=compute_s / predicted_s, stage_factors=stage_factors,
                                     tied_s=tied_s, optimizer_s=optimizer_s, send_s=send_s, recv_s=recv_s,
                                     transfer_s=transfer_s, waited_s=waited_s, step_variation=step_variation,
                                     step_s=statistics.median(ends[t] for t in steps),
                                     step_of=plan_shape(plan.schedule.kind, plan.schedule.microbatches,
                                                        [stage.blocks for stage in plan.stages])),
        compute_s=compute_s, predicted_s=predicted_s, steps=len(steps),
    )  # fmt: skip


def _step_variation(steps: list[int], took: dict[tuple[int, str], float], deliveries: dict[tuple[int, str], float],
                    tails: dict[tuple[int, int], float]) -> tuple[dict[str, float], ...]:
    """Per step (at most `VARIATION_STEPS`, evenly spaced), how each action, delivery and tail
    differed from its median (`PipelineMeasurement.step_variation`): which ranks a slow moment of
    the machine caught in the same step, and which message came late, for the step model to run
    the pipeline through each of those steps."""
    def median_of(values: dict[tuple[int, object], float]) -> dict[object, float]:
        by_key: dict[object, list[float]] = {}
        for (_, key), seconds in values.items():
            by_key.setdefault(key, []).append(seconds)
        return {key: statistics.median(v) for key, v in by_key.items()}

    typical_took, typical_tail, typical_delivery = median_of(took), median_of(tails), median_of(deliveries)
    kept = [steps[round(i * (len(steps) - 1) / (VARIATION_STEPS - 1))] for i in range(VARIATION_STEPS)] \
        if len(steps) > VARIATION_STEPS else steps
    variation = []
    for step in kept:
        moved = {name: took[step, name] / typical_took[name] for name in typical_took
                 if (step, name) in took and typical_took[name] > 0}
        moved.update({name: seconds - typical_delivery[name] for (t, name), seconds in deliveries.items() if t == step})
        moved.update({tail_key(pp): tails[step, pp] / typical_tail[pp] for pp in typical_tail
                      if (step, pp) in tails and typical_tail[pp] > 0})
        variation.append(moved)
    return tuple(variation)


def _deliveries(messages: dict[tuple[int, int, int, str], tuple[float, float]]) -> dict[tuple[int, str], float]:
    """(step, receive) -> seconds from the later of its start and its send's end to its end (its
    slowest copy's): how long the data took to be had once it was both sent and asked for."""
    deliveries: dict[tuple[int, str], float] = {}
    for (step, dp, tp, name), (start, end) in messages.items():
        send = messages.get((step, dp, tp, _send_of(name))) if Action.parse(name).kind in RECEIVE_KINDS else None
        if send is not None:
            deliveries[step, name] = max(deliveries.get((step, name), 0.0), end - max(start, send[1]))
    return deliveries


def _send_of(receive: str) -> str:
    """The send that a receive pairs with: ``1RECV_F3`` -> ``0SEND_F3``, ``0RECV_B3`` -> ``1SEND_B3``."""
    return str(Action.parse(receive).partner)


ARRIVED_S = 5e-4
"""A receive that starts this long after its send ended finds the data there (a small message
crosses between processes of one host well within it): its time is the receive's own."""


def message_times(messages: dict[tuple[int, int, int, str], tuple[float, float]]) -> tuple[float | None, ...]:
    """(send, receive, transfer, waited) seconds as the step model takes them (`StageCosts`), from
    the pipeline's sends and receives on the host's clock: a send's time; a receive's when its data
    was there; what a receive that waited took from the end of its send, less a receive's time
    (not below 0); and all of what it took from the end of its send."""
    sends, receives, waited = [], [], []
    for (step, dp, tp, name), (start, end) in messages.items():
        if Action.parse(name).kind not in RECEIVE_KINDS:
            sends.append(end - start)
            continue
        send = messages.get((step, dp, tp, _send_of(name)))
        if send is None:
            continue
        if start >= send[1] + ARRIVED_S:
            receives.append(end - start)
        elif start <= send[0]:
            # not below 0: a sender descheduled after its data left records its end after the receive's
            waited.append(max(0.0, end - send[1]))
    if not (sends and receives and waited):
        return None, None, None, None
    send_s, recv_s, waited_s = statistics.median(sends), statistics.median(receives), statistics.median(waited)
    return send_s, recv_s, max(0.0, waited_s - recv_s), waited_s


def profile_pipeline(out_dir: Path, plan: Plan, overheads: RuntimeOverheads, *, cores: int,
                     timeout_s: float = 600.0) -> PipelineProfile:
    """Run the programs in ``out_dir`` on this host's CPU for `run_arguments` and measure them."""
    with tempfile.TemporaryDirectory(prefix="autopart-pipeline-") as folder:
        work = Path(folder)
        run_locally(out_dir, plan.world_size, [*run_arguments(), "--action-times", str(work / "actions")],
                    timeout_s=timeout_s, cwd=work)
        try:
            return measure(plan, work / "actions", overheads, cores=cores)
        except RuntimeError as exc:  # a run that ended well but left times that cannot be read
            raise LocalRunError(f"the run's action times could not be read: {exc}") from None


def run_arguments() -> list[str]:
    """``train.py``'s arguments of `profile_pipeline`'s run: `WARMUP_STEPS`, then
    `MEASURED_SECONDS` (capped by `autopart.profiling.span`), at least `MEASURED_STEPS` and at
    most `MAX_STEPS` steps."""
    return timed_run(MEASURED_SECONDS, warmup=WARMUP_STEPS, least=MEASURED_STEPS, most=MAX_STEPS)


PROFILE_PIPELINE_ROUNDS = 3

DEFAULT_RUN_SECONDS = 60.0
"""The longest predicted run (warm-up and the least measured steps) the default compile makes to
measure a pipeline it was not asked to: a large model's steps take minutes on a CPU."""


def affordable(plan: Plan) -> bool:
    """Whether the default compile runs ``plan``'s pipeline here: its shortest run (`WARMUP_STEPS`
    and `MEASURED_STEPS` of its predicted step) within `DEFAULT_RUN_SECONDS`."""
    return (WARMUP_STEPS + MEASURED_STEPS) * plan.predicted.step_s <= DEFAULT_RUN_SECONDS


def profiled_in_place(plan: Plan, front: Front, recompile: Callable[[], tuple[Plan, Front]], *,
                      console: Console | None = None) -> tuple[Plan, Front]:
    """``plan`` once its pipeline's compute factor is measured: run, store, compile again
    (``recompile()`` gives the next plan and its front), until the plan compiled is one whose
    pipeline was run (the factor can move the search to another mesh), at most
    `PROFILE_PIPELINE_ROUNDS` runs. ``console`` says what runs while it runs."""
    for _ in range(PROFILE_PIPELINE_ROUNDS):
        if plan.predicted.compute_factor_from == "pipeline":
            break
        database = front.cost_model.database
        step_s = plan.predicted.step_s
        each = f"{step_s * 1e3:.3g} ms" if step_s < 1 else f"{step_s:.3g} s"  # predicted: the run times them
        measured = min(max(span(MEASURED_SECONDS), MEASURED_STEPS * step_s), MAX_STEPS * step_s)
        seconds = WARMUP_STEPS * step_s + measured
        showing = console.status(f"running the plan to time its pipeline ({plan.world_size} processes, ~{seconds:.3g} s "
                                 f"of steps predicted at {each})") if console is not None else nullcontext()
        with showing, tempfile.TemporaryDirectory(prefix="autopart-profile-pipeline-") as folder:
            out = emit_directory(plan, front.op_graph, front.spec, Path(folder) / "out", chain=front.chain)
            profiled = profile_pipeline(out, plan, front.cost_model.runtime_overheads,
                                        cores=front.cost_model.device.cores)
        measured = replace(profiled.measured, background_load=front.cost_model.device.background_load)
        database.put_pipeline(front.cost_model.device.name, profiled.key, measured)
        database.save()
        plan, front = recompile()
    return plan, front
