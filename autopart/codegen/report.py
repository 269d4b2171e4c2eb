"""The human side of the output directory: report.md, the predicted timeline as a picture and a
Chrome trace, and the per-rank action lists as CSV.

A plan of a thousand microbatches over a hundred ranks has hundreds of thousands of actions to
draw and trace, seconds of work that nothing else in the directory waits for: `begin_report`
writes them in forked processes beside the rest (where the platform forks: Linux).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autopart.ir.forked import Forked
from autopart.ir.plan import Plan
from autopart.ir.tensors import PRECISION_TEXT
from autopart.predict.accuracy import MFU_CEILING, describe_prediction, mfu_clause
from autopart.predict.timeline import plan_schedule, plan_timeline
from autopart.schedule import worth_forking, write_chrome_trace, write_gantt_png, write_schedule_csv

__all__ = ["ESTIMATED_NOTE", "begin_report", "collectives_line", "report_forks", "write_report", "search_table", "stage_table"]

_GIB = 1 << 30


def stage_table(plan: Plan) -> list[list[str]]:
    """Rows of the per-stage table: stage, its pipeline rank (the mesh's pp coordinate, not a
    process's rank where tp or dp is above 1), blocks, parameters, memory, predicted times."""
    rows = [["stage", "pp rank", "blocks", "params MB", "memory GiB", "fwd ms", "bwd ms", "stage ms"]]
    for stage in plan.stages:
        rows.append(
            [
                str(stage.index),
                str(stage.rank),
                f"{stage.blocks[0]}-{stage.blocks[1]}",
                f"{stage.parameter_bytes / 1e6:.3f}",
                f"{plan.predicted.memory_bytes[stage.rank] / _GIB:.3f}",
                f"{stage.forward_s * 1e3:.3f}",
                f"{stage.backward_s * 1e3:.3f}",
                f"{plan.predicted.stage_time_s[stage.index] * 1e3:.3f}",
            ]
        )
    return rows


def search_table(plan: Plan) -> list[list[str]]:
    """Rows of the search's table: the chosen plan, then the runners-up, with their predictions
    and, where the finalists ran here (`autopart.profiling.finalists`), their measured steps."""
    ranked = plan.provenance.search.get("ranked", [])
    ran = any("measured_step_s" in entry for entry in ranked)
    rows = [["#", "layout", "recompute", "step ms", "vs chosen", "peak memory GiB", *(["ran here ms"] if ran else [])]]
    best = ranked[0]["step_s"] if ranked else plan.predicted.step_s
    for i, entry in enumerate(ranked):
        modes = entry["recompute"]
        recompute = modes[0] if len(set(modes)) == 1 else ",".join(modes)
        measured = entry.get("measured_step_s")
        about = "~" if entry.get("estimated") else ""  # the search's estimate, the full model not planned
        rows.append([str(i + 1), entry["layout"], recompute, f"{about}{entry['step_s'] * 1e3:.3f}",
                     f"{about}{entry['step_s'] / best:.3f}x", f"{entry['memory_bytes'] / _GIB:.2f}",
                     *([f"{measured * 1e3:.3f}" if measured is not None else "-"] if ran else [])])
    return rows


ESTIMATED_NOTE = ("~: the search's estimate on its shallow copy of the model (a few layers), no faster than the "
                  "chosen plan's, so the full model was not planned for it; pin that layout for its prediction")
"""Said under a search table whose rows hold such estimates."""


def _markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def _tensor_parallel(plan: Plan) -> str:
    if plan.mesh["tp"] == 1:
        return ""
    cut = sum(len(stage.overlapped) for stage in plan.stages)
    overlap = (f"; {cut} linears run in pieces beside their collectives (--tp-overlap)" if cut else
               "; --tp-overlap found no linear whose collectives pieces would hide" if plan.tp_overlap else "")
    return f"\nTensor parallelism: {'with' if plan.sp else 'without'} sequence parallelism{overlap}."


def collectives_line(plan: Plan) -> str:
    """Under ZeRO-2/3, what the data-parallel collectives add to each forward and backward of each
    stage: inside the pipeline (the trace's actions, the bubble, the step), outside the table's
    fwd, bwd and stage columns, which are the stage's own compute and transfers. "" for none."""
    if not plan.predicted.collective_s:
        return ""
    added = ", ".join(f"{f * 1e3:.3f}/{b * 1e3:.3f}" for f, b in plan.predicted.collective_s)
    return (f"ZeRO-{plan.zero}'s collectives add to each forward/backward, per stage, ms: {added} "
            "(in the pipeline and the trace; not in the table's fwd, bwd and stage columns)")


def _per_pipeline(plan: Plan) -> str:
    """Where the plan has data-parallel replicas, that the bytes sent are each pipeline's."""
    return f" in each of its {plan.mesh['dp']} pipelines" if plan.mesh["dp"] > 1 else ""


def write_report(plan: Plan, out: Path) -> None:
    """The whole report, in this process: each of `PARTS` in turn."""
    for _, part in PARTS:
        part(plan, out)


def _title(plan: Plan) -> str:
    """The trace's and the picture's title. Under an MFU ceiling their actions are the kernels'
    times, faster than the step the plan predicts, and the title says so."""
    title = f"{Path(plan.provenance.model_file).name}: {plan.schedule.kind}, pp={plan.mesh['pp']}, m={plan.schedule.microbatches}"
    if plan.predicted.unbounded_step_s is not None:
        title += (f" (the kernels' times; the ~{MFU_CEILING:.0%} MFU ceiling puts the step at "
                  f"{plan.predicted.step_s * 1e3:.3f} ms)")
    return title


def _trace(plan: Plan, out: Path) -> None:
    write_chrome_trace(plan_timeline(plan), out / "trace.json", title=_title(plan), step_s=plan.predicted.step_s)


def _picture_and_text(plan: Plan, out: Path) -> None:
    write_gantt_png(plan_timeline(plan), out / "timeline.png", title=_title(plan), step_s=plan.predicted.step_s)
    write_schedule_csv(plan_schedule(plan, lowered=False), out / "schedule.csv")
    predicted = plan.predicted
    text = f"""# autopart plan for {Path(plan.provenance.model_file).name}

Mesh: pp={plan.mesh['pp']}, tp={plan.mesh['tp']}, dp={plan.mesh['dp']} ({plan.world_size} processes).{_tensor_parallel(plan)}
Schedule: {plan.schedule.kind}, {plan.schedule.microbatches} microbatches of {plan.schedule.micro_batch_size} (global batch {plan.schedule.global_batch_size}).
Precision: {plan.dtype}{"" if plan.dtype == "fp32" else f" ({PRECISION_TEXT[plan.dtype]})"}. Activation recompute per stage: {", ".join(st.recompute for st in plan.stages)}.

Predicted step time {predicted.step_s * 1e3:.3f} ms{describe_prediction(plan)}{mfu_clause(plan)}, bubble {predicted.bubble:.1%}, {predicted.p2p_bytes_per_step / 1e6:.3f} MB sent between stages per step{_per_pipeline(plan)}.
Cost model: {plan.provenance.cost_model}. Solver: {plan.provenance.solver_status} (objective {plan.provenance.objective_s * 1e3:.3f} ms, bound {plan.provenance.bound_s * 1e3:.3f} ms, gap {plan.provenance.gap:.2%}).

{_markdown(stage_table(plan))}
{collectives_line(plan) and chr(10) + collectives_line(plan) + "." + chr(10)}
Per stage: its pipeline rank (pp rank: tp x dp = {plan.mesh['tp'] * plan.mesh['dp']} processes each), its parameters in
their own dtype before tensor-parallel sharding (params MB), and one device's peak memory (memory GiB).
Memory: weights, gradients and optimizer state ({plan.optimizer}), plus the buffers the stage's ops
read (whole on each rank; one its forward updates with the copies kept to move it once a step), plus the
activations of the microbatches that the schedule keeps in flight (what each stage's recompute
mode keeps), plus the activations that a recomputing backward holds while it runs, plus, under a
split backward (zb-h1, zbv), the gradients each stage's input half keeps for its weight half, plus the
loss's backward, plus framework overhead.
Tied parameters held by several stages: {", ".join(f"{k} (stages {', '.join(map(str, v))})" for k, v in plan.tied_parameters.items()) or "none"}.

Files: `plan.json` (the plan), `stages/` (one module per stage), `weights/`, `train.py` (the entry point),
`timeline.png` and `trace.json` (the predicted schedule), `schedule.csv` (per-rank actions).
"""
    (out / "report.md").write_text(text)


def report_forks(plan: Plan) -> bool:
    """Whether `begin_report` should write ``plan``'s report in forked processes: its schedule's
    size (``autopart.schedule.worth_forking``)."""
    return worth_forking(plan.schedule.kind, plan.mesh["pp"], plan.schedule.microbatches, plan.schedule.chunks)


PARTS: tuple[tuple[str, Callable[[Plan, Path], None]], ...] = (
    ("trace.json", _trace),
    ("timeline.png, schedule.csv, report.md", _picture_and_text),
)
"""The report's parts, each ``(its files, part(plan, out))``, of about equal work for a long
pipeline: the trace; the picture, the action list and the text."""


class ReportInProgress:
    """The report's parts begun (`begin_report`): `wait` raises what went wrong in any, `stop`
    ends them all (before the folder they write in is removed)."""

    def __init__(self, parts: list[Forked]):
        self._parts = parts

    def wait(self) -> None:
        for part in self._parts:
            part.wait()

    def stop(self) -> None:
        for part in self._parts:
            part.stop()


def begin_report(plan: Plan, out: Path, *, fork: bool = True) -> ReportInProgress:
    """`write_report(plan, out)` begun, each of `PARTS` in a forked process of its own beside the
    compile's (the stage programs it writes meanwhile take less time than either part of a long
    pipeline's report); in this process, at once and in turn, with ``fork`` False or where it may
    not fork (`Forked`). Each part finds the plan's timeline in the cache it forked with where
    the compile simulated it (a generated schedule), else simulates it."""
    return ReportInProgress([Forked(lambda part=part: part(plan, out), what=f"writing the report's {files}", fork=fork)
                             for files, part in PARTS])
