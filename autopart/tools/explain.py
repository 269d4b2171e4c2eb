"""``autopart explain OUT [--trace FILE]``: what a compiled plan predicts, and how a measured step
compares with it.

The prediction is the simulated timeline of the plan's schedule (the one compile drew in
``timeline.png``); the measurement is a trace written by ``OUT/train.py --trace FILE``. Both are
`Timeline` values of the same schedule, so every figure is computed the same way from both:
per stage, the mean forward and backward of one microbatch (a split backward counts as I + W)
and the stage's compute time in one step; for the whole pipeline, the step time and the bubble.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from autopart.ir.errors import ConfigError, ScheduleError
from autopart.ir.plan import Plan, load_plan
from autopart.predict.timeline import plan_timeline
from autopart.runtime.launch import check_output
from autopart.schedule import Kind, Timeline, read_chrome_trace

__all__ = ["StageFigures", "Comparison", "load_output", "refused_as_it_is", "compare", "stage_figures", "comparison_rows", "relative_error",
           "step_lines"]


@dataclass(frozen=True, kw_only=True)
class StageFigures:
    """Seconds: mean forward and backward of one microbatch, and all of the stage's compute in a step."""

    forward_s: float
    backward_s: float
    busy_s: float


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Predicted and measured figures of one plan, per stage and for the step."""

    predicted: dict[int, StageFigures]
    measured: dict[int, StageFigures]
    step_s: tuple[float, float]  # predicted, measured
    bubble: tuple[float, float]


def load_output(out_dir: Path) -> Plan:
    """The plan of an output directory, with one-line errors for what is not one."""
    if not out_dir.exists():
        raise ConfigError(
            f"output directory '{out_dir}' does not exist; write it with autopart compile MODEL.py -o {out_dir}"
        )
    if not out_dir.is_dir() or not (out_dir / "plan.json").is_file():
        raise ConfigError(
            f"'{out_dir}' is not an autopart output directory (it has no plan.json); "
            "give the -o directory of autopart compile"
        )
    return load_plan(out_dir / "plan.json")


def refused_as_it_is(out_dir: Path, plan: Plan) -> str | None:
    """Why train.py would refuse ``out_dir`` now (a stage file or model.py edited or deleted since
    the compile), or None: the figures explain prints are the plan's, not the edited files'."""
    try:
        check_output(out_dir, plan)
    except ConfigError as exc:
        return str(exc)
    return None


def stage_figures(timeline: Timeline) -> dict[int, StageFigures]:
    durations: dict[tuple[int, Kind], list[float]] = defaultdict(list)
    for event in timeline.events:
        durations[(event.action.stage, event.action.kind)].append(event.end - event.start)

    def mean(stage: int, kind: Kind) -> float:
        values = durations.get((stage, kind), [])
        return sum(values) / len(values) if values else 0.0

    stages = sorted({stage for stage, _ in durations})
    return {
        s: StageFigures(
            forward_s=mean(s, Kind.F),
            backward_s=mean(s, Kind.B) + mean(s, Kind.I) + mean(s, Kind.W),
            busy_s=sum(sum(durations.get((s, kind), [])) for kind in Kind),
        )
        for s in stages
    }


def compare(plan: Plan, trace: Path) -> Comparison:
    """Read a measured trace of ``plan``'s schedule and set it beside the prediction."""
    measured = read_chrome_trace(trace)
    predicted = plan_timeline(plan)
    want = sorted(str(e.action) for e in predicted.events)
    got = sorted(str(e.action) for e in measured.events)
    if got != want:
        missing = sorted(set(want) - set(got))[:3]
        extra = sorted(set(got) - set(want))[:3]
        raise ScheduleError(
            f"trace {trace} is not a step of this plan ({plan.schedule.kind}, {len(plan.stages)} stages, "
            f"{plan.schedule.microbatches} microbatches): it has {len(got)} actions, the plan {len(want)}"
            f"{', missing ' + ' '.join(missing) if missing else ''}{', extra ' + ' '.join(extra) if extra else ''}; "
            "measure it with OUT/train.py --trace FILE"
        )
    return Comparison(
        predicted=stage_figures(predicted),
        measured=stage_figures(measured),
        step_s=(predicted.step_s, measured.step_s),
        bubble=(predicted.bubble, measured.bubble),
    )


def comparison_rows(comparison: Comparison, plan: Plan) -> list[list[str]]:
    """A row per stage and figure: predicted and measured milliseconds and the relative error."""
    rows = [["stage", "pp rank", "figure", "predicted ms", "measured ms", "error"]]
    # under ZeRO-2/3 both count the gathers and reduce-scatters run inside them, as the stage table above does not
    gathered, scattered = (" with its gathers", " with its reduce-scatters") if any(f or b for f, b in plan.predicted.collective_s) else ("", "")
    for stage in plan.stages:
        p, m = comparison.predicted[stage.index], comparison.measured[stage.index]
        for name, predicted, measured in (
            ("forward" + gathered, p.forward_s, m.forward_s),
            ("backward" + scattered, p.backward_s, m.backward_s),
            ("per step", p.busy_s, m.busy_s),
        ):
            rows.append(
                [str(stage.index), str(stage.rank), name, f"{predicted * 1e3:.3f}", f"{measured * 1e3:.3f}",
                 relative_error(predicted, measured)]
            )  # fmt: skip
    return rows


def step_lines(comparison: Comparison, plan: Plan) -> list[str]:
    """The lines under the table: the pipeline's span, predicted and measured, and what the plan's
    step holds beyond it, which a trace does not time."""
    (step_p, step_m), (bubble_p, bubble_m) = comparison.step_s, comparison.bubble
    lines = [f"pipeline (the trace's span: forwards, backwards, transfers): predicted {step_p * 1e3:.3f} ms, measured "
             f"{step_m * 1e3:.3f} ms ({relative_error(step_p, step_m)}); bubble: predicted {bubble_p:.1%}, measured "
             f"{bubble_m:.1%}"]
    predicted = plan.predicted
    modelled = predicted.modelled_step_s  # beneath an MFU ceiling, what the models gave
    shared = (f", the turns its ranks take on cores shared with {predicted.background_load:g} other busy processes"
              if predicted.background_load > 0 else "")  # inside the pipeline, which the trace's own times leave out
    if modelled > step_p:
        lines.append(f"the predicted step of {modelled * 1e3:.3f} ms adds {(modelled - step_p) * 1e3:.3f} ms to the "
                     f"pipeline (the gradient reduction, the optimizer step and the step's own overheads{shared}), which "
                     "the trace does not time; train.py --metrics measures whole steps"
                     + (f"; the MFU ceiling raises it to {predicted.step_s * 1e3:.3f} ms" if predicted.unbounded_step_s
                        else ""))
    return lines


def relative_error(predicted: float, measured: float) -> str:
    """How far the measurement is from the prediction, as a signed share of the prediction."""
    if predicted <= 0:
        return "n/a"
    return f"{(measured - predicted) / predicted:+.0%}"
