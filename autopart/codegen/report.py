"""The human side of the output directory: report.md, the predicted timeline as a picture and a
Chrome trace, and the per-rank action lists as CSV.

A plan of a thousand microbatches over a hundred ranks has hundreds of thousands of actions to
draw and trace, seconds of work that nothing else in the directory waits for: `ReportWriter`
writes them in a forked process beside the rest (where the platform forks: Linux).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import traceback
from pathlib import Path

from autopart.ir.plan import Plan
from autopart.ir.tensors import PRECISION_TEXT
from autopart.predict.accuracy import describe_prediction
from autopart.predict.timeline import plan_schedule, plan_timeline
from autopart.schedule import write_chrome_trace, write_gantt_png, write_schedule_csv

__all__ = ["ReportWriter", "report_forks", "write_report", "search_table", "stage_table"]

_GIB = 1 << 30


def stage_table(plan: Plan) -> list[list[str]]:
    """Rows of the per-stage table: stage, rank, blocks, parameters, memory, predicted times."""
    rows = [["stage", "rank", "blocks", "params MB", "memory GiB", "fwd ms", "bwd ms", "stage ms"]]
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
        rows.append([str(i + 1), entry["layout"], recompute, f"{entry['step_s'] * 1e3:.3f}",
                     f"{entry['step_s'] / best:.3f}x", f"{entry['memory_bytes'] / _GIB:.2f}",
                     *([f"{measured * 1e3:.3f}" if measured is not None else "-"] if ran else [])])
    return rows


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


def write_report(plan: Plan, out: Path) -> None:
    timeline = plan_timeline(plan)
    title = f"{Path(plan.provenance.model_file).name}: {plan.schedule.kind}, pp={plan.mesh['pp']}, m={plan.schedule.microbatches}"
    write_gantt_png(timeline, out / "timeline.png", title=title)
    write_chrome_trace(timeline, out / "trace.json", title=title)
    write_schedule_csv(plan_schedule(plan, lowered=False), out / "schedule.csv")
    predicted = plan.predicted
    text = f"""# autopart plan for {Path(plan.provenance.model_file).name}

Mesh: pp={plan.mesh['pp']}, tp={plan.mesh['tp']}, dp={plan.mesh['dp']} ({plan.world_size} processes).{_tensor_parallel(plan)}
Schedule: {plan.schedule.kind}, {plan.schedule.microbatches} microbatches of {plan.schedule.micro_batch_size} (global batch {plan.schedule.global_batch_size}).
Precision: {plan.dtype}{"" if plan.dtype == "fp32" else f" ({PRECISION_TEXT[plan.dtype]})"}. Activation recompute per stage: {", ".join(st.recompute for st in plan.stages)}.

Predicted step time {predicted.step_s * 1e3:.3f} ms{describe_prediction(plan)}, bubble {predicted.bubble:.1%}, {predicted.p2p_bytes_per_step / 1e6:.3f} MB sent between stages per step.
Cost model: {plan.provenance.cost_model}. Solver: {plan.provenance.solver_status} (objective {plan.provenance.objective_s * 1e3:.3f} ms, bound {plan.provenance.bound_s * 1e3:.3f} ms, gap {plan.provenance.gap:.2%}).

{_markdown(stage_table(plan))}

Memory: weights, gradients and optimizer state ({plan.optimizer}), plus the
activations of the microbatches that the schedule keeps in flight (what each stage's recompute
mode keeps), plus the activations that a recomputing backward holds while it runs, plus framework overhead.
Tied parameters held by several stages: {", ".join(f"{k} (stages {', '.join(map(str, v))})" for k, v in plan.tied_parameters.items()) or "none"}.

Files: `plan.json` (the plan), `stages/` (one module per stage), `weights/`, `train.py` (the entry point),
`timeline.png` and `trace.json` (the predicted schedule), `schedule.csv` (per-rank actions).
"""
    (out / "report.md").write_text(text)


FORK_FROM_ACTIONS = 20_000
"""Compute actions in a plan's schedule from which its report is written by a forked process: a
smaller one is drawn in a fraction of a second, less than forking a large compile costs."""


def report_forks(plan: Plan) -> bool:
    """Whether `ReportWriter` should write ``plan``'s report in a forked process (its size)."""
    return plan.schedule.microbatches * len(plan.stages) * 3 >= FORK_FROM_ACTIONS


class ReportWriter:
    """`write_report(plan, out)` begun in a forked process (here with ``fork`` False, or where
    this process may not fork or start children); `wait` raises what went wrong in it, and
    `stop` ends it (before the folder it writes in is removed)."""

    def __init__(self, plan: Plan, out: Path, *, fork: bool = True):
        self._process = None
        if not fork or not sys.platform.startswith("linux") or multiprocessing.current_process().daemon:
            write_report(plan, out)
            return
        context = multiprocessing.get_context("fork")
        self._reading, writing = context.Pipe(duplex=False)

        def child() -> None:
            # a thread of the parent (the progress bar's) may have held stderr's lock as it forked:
            # the child writes nowhere but its pipe, and ends without flushing what it inherited
            sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the child's for its life
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's, which stops it
            try:
                write_report(plan, out)
                writing.send(None)
            except BaseException:  # its traceback, to the parent, which raises it
                writing.send(traceback.format_exc())
            os._exit(0)

        self._process = context.Process(target=child, daemon=True)
        self._process.start()
        writing.close()  # the child's end alone stays open: its death reads as the end of the pipe

    def wait(self) -> None:
        if self._process is None:
            return
        try:
            error = self._reading.recv()
        except EOFError:  # it died before it could say why (killed, out of memory)
            error = None
        self._process.join()
        self._reading.close()
        if error is None and self._process.exitcode != 0:
            error = f"its process ended with code {self._process.exitcode}"
        self._process = None
        if error:
            raise RuntimeError(f"writing the report (report.md, timeline.png, trace.json) failed:\n{error}")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.join()
            self._reading.close()
            self._process = None
