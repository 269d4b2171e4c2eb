"""Write schedules and timelines where people and tools can look at them.

- Chrome trace JSON (``trace.json``): the simulator's prediction and the runtime's measurement
  are written in the same form, so they open side by side in Perfetto or chrome://tracing, and
  `read_chrome_trace` turns either back into a `Timeline` for comparison.
- A Gantt chart (``timeline.png``) for the report: a row per rank, one colour per action kind.
- torch.distributed.pipelining's CSV (``schedule.csv``): one row per rank, one action string per
  cell, which torch's ``_load_csv`` reads, so a schedule can be tried with torch's runtime and
  a hand-edited CSV can come back through `read_schedule_csv`.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from autopart.ir.errors import ScheduleError
from autopart.ir.actions import Action, Kind, Schedule
from autopart.schedule.simulate import Event, Timeline

__all__ = [
    "chrome_trace_events",
    "write_chrome_trace",
    "read_chrome_trace",
    "write_gantt_png",
    "write_schedule_csv",
    "read_schedule_csv",
]

_US_PER_S = 1e6
_COLUMNS = 1_000  # pixel columns of the drawn time axis, about (1,200 wide with the labels and legend)
_LIGHT_ALPHA = 0.6  # odd chunks' bars, so the rounds through a rank's chunks can be told apart
_MAX_ROWS_DRAWN_TALL = 32  # ranks drawn half an inch high each; more share the height, every k-th labelled

# Colour-blind-safe (Okabe-Ito): forward blue, full backward green, I orange, W purple.
_COLOURS = {Kind.F: "#0072B2", Kind.B: "#009E73", Kind.I: "#E69F00", Kind.W: "#CC79A7"}
_LABELS = {
    Kind.F: "F forward",
    Kind.B: "B backward",
    Kind.I: "I input grad",
    Kind.W: "W weight grad",
}


def chrome_trace_events(timeline: Timeline) -> list[dict[str, Any]]:
    """The Chrome-trace events of ``timeline``: a "thread_name" record per rank, then one
    complete ("X") event per action with ts and dur in microseconds, pid 0 and tid = rank."""
    return [*_thread_names(timeline),
            *(_complete_event(event) for event in sorted(timeline.events, key=lambda e: (e.rank, e.start)))]


def _complete_event(event: Event) -> dict[str, Any]:
    action = event.action
    return {
        "name": str(action),
        "cat": action.kind.value,
        "ph": "X",
        "pid": 0,
        "tid": event.rank,
        "ts": event.start * _US_PER_S,
        "dur": (event.end - event.start) * _US_PER_S,
        "args": {"stage": action.stage, "microbatch": action.microbatch},
    }


def write_chrome_trace(timeline: Timeline, path: str | Path, *, title: str = "", step_s: float | None = None) -> None:
    """Write ``timeline`` as a Chrome trace JSON file (open it in Perfetto): `chrome_trace_events`,
    one event per line (an indented document goes through json's Python encoder). Its figures say
    what they are: ``pipeline_s`` the actions' span, ``step_s`` (where given) a plan's whole step,
    which adds what follows the pipeline (the gradient reduction, the optimizer step)."""
    head = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}] if title else []
    head += _thread_names(timeline)
    other = {"title": title, "pipeline_s": timeline.step_s, "bubble": timeline.bubble}
    other |= {"step_s": step_s} if step_s is not None else {}
    lines = ",\n".join([*(json.dumps(event) for event in head), *_complete_events(timeline)])
    Path(path).write_text(f'{{"traceEvents": [\n{lines}\n],\n"displayTimeUnit": "ms",\n"otherData": {json.dumps(other)}}}\n')


def _thread_names(timeline: Timeline) -> list[dict[str, Any]]:
    ranks = sorted({event.rank for event in timeline.events})
    return [{"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}} for rank in ranks]


def _complete_events(timeline: Timeline) -> list[str]:
    """``json.dumps`` of each complete event of `chrome_trace_events`, written straight from the
    timeline: a long pipeline has a million, and building each as a dict first took as long as
    writing it (an action's name and a kind's value need no escaping; floats as json writes
    them, repr)."""
    lines = []
    for event in sorted(timeline.events, key=lambda e: (e.rank, e.start)):
        action, ts, dur = event.action, event.start * _US_PER_S, (event.end - event.start) * _US_PER_S
        if not (math.isfinite(ts) and math.isfinite(dur)):
            lines.append(json.dumps(_complete_event(event)))
            continue
        lines.append(f'{{"name": "{action}", "cat": "{action.kind.value}", "ph": "X", "pid": 0, '
                     f'"tid": {event.rank}, "ts": {ts!r}, "dur": {dur!r}, '
                     f'"args": {{"stage": {action.stage}, "microbatch": {action.microbatch}}}}}')
    return lines


def read_chrome_trace(path: str | Path) -> Timeline:
    """Read a trace written by `write_chrome_trace`, or measured by the runtime in that form.

    Complete ("X") events named by a compute action become events; other spans (an optimizer
    step, a wait on a receive) are not part of the schedule and are skipped. The number of
    ranks counts every rank named by a "thread_name" record, idle ones included.
    """
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as exc:  # not JSON, not text at all, nested past the parser
        raise ScheduleError(f"cannot read the trace {path}: {exc}; give a trace that OUT/train.py --trace FILE "
                            "wrote") from None
    raw = document.get("traceEvents") if isinstance(document, dict) else document
    if not isinstance(raw, list):
        raise ScheduleError(f"{path} is not a Chrome trace: it has no traceEvents list")
    spans: list[tuple[int, Action, float, float]] = []  # rank, action, ts and dur in µs
    ranks: set[int] = set()
    for record in raw:
        if not isinstance(record, dict):
            continue
        if record.get("ph") == "M" and record.get("name") == "thread_name":
            ranks.add(int(record.get("tid", 0)))
        if record.get("ph") != "X":
            continue
        try:
            action = Action.parse(str(record.get("name", "")))
        except ScheduleError:
            continue
        if not action.is_compute:
            continue
        try:
            spans.append((int(record["tid"]), action, float(record["ts"]), float(record["dur"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ScheduleError(f"{path}: event {record.get('name')!r} lacks tid/ts/dur") from exc
        ranks.add(spans[-1][0])
    # Shift in microseconds before converting: a measured clock may count from the epoch, where
    # seconds as floats would lose the microseconds.
    origin = min((ts for _, _, ts, _ in spans), default=0.0)
    events = [
        Event(
            rank=rank,
            action=action,
            start=(ts - origin) / _US_PER_S,
            end=(ts - origin + dur) / _US_PER_S,
        )
        for rank, action, ts, dur in spans
    ]
    return Timeline.from_events(events, ranks=max(ranks) + 1 if ranks else 1)


def write_gantt_png(timeline: Timeline, path: str | Path, *, title: str = "", step_s: float | None = None) -> None:
    """Draw ``timeline`` as a Gantt chart: a row per rank, microbatch numbers on the bars; its
    heading gives the actions' span and, where given, the plan's whole step (``step_s``).

    With several model chunks per rank (interleaved), odd chunks are drawn lighter so that the
    rounds through the chunks can be told apart.
    """
    # The object API with an Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    by_rank = timeline.per_rank()
    ranks = max(by_rank) + 1 if by_rank else 1
    figure = Figure(figsize=(12, 1.2 + 0.5 * min(ranks, _MAX_ROWS_DRAWN_TALL)), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    step = timeline.step_s or 1.0
    if max((len(events) for events in by_rank.values()), default=0) > _COLUMNS:
        _draw_coverage(axes, by_rank, ranks, step)
    else:
        _draw_bars(axes, by_rank, ranks, step)
    labelled = range(0, ranks, max(1, ranks // _MAX_ROWS_DRAWN_TALL))
    axes.set_yticks(labelled, [f"rank {rank}" for rank in labelled])
    axes.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top, as in the papers' figures
    axes.set_xlim(0, step)
    axes.set_xlabel("seconds")
    kinds = [kind for kind in _COLOURS if any(e.action.kind is kind for e in timeline.events)]
    axes.legend(
        handles=[Patch(color=_COLOURS[kind], label=_LABELS[kind]) for kind in kinds],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        frameon=False,
    )
    of_step = f" of a {step_s * 1e3:.3f} ms step" if step_s is not None else ""
    heading = f"pipeline {timeline.step_s * 1e3:.3f} ms{of_step}, bubble {timeline.bubble:.1%}"
    axes.set_title(f"{title}\n{heading}" if title else heading)  # two lines: a long title is not cut off
    figure.tight_layout()
    figure.savefig(path)


def _lighter(event: Event, ranks: int) -> bool:
    """Whether ``event`` is drawn in the lighter shade: an odd chunk of its rank (interleaved)."""
    return (event.action.stage // ranks) % 2 == 1


def _draw_bars(axes: Any, by_rank: dict[int, list[Event]], ranks: int, step: float) -> None:
    """A bar per action, one collection per rank, kind and shade (a patch per bar draws slowly)."""
    bars: dict[tuple[int, Kind, bool], list[tuple[float, float]]] = {}
    for rank, events in by_rank.items():
        for event in events:
            width = event.end - event.start
            bars.setdefault((rank, event.action.kind, _lighter(event, ranks)), []).append((event.start, width))
            if width > step / 150:
                axes.text(event.start + width / 2, rank, str(event.action.microbatch), ha="center", va="center",
                          fontsize=7, color="white")
    for (rank, kind, light), spans in bars.items():
        axes.broken_barh(spans, (rank - 0.4, 0.8), facecolors=_COLOURS[kind], alpha=_LIGHT_ALPHA if light else 1.0,
                         edgecolor="white", linewidth=0.5)


def _draw_coverage(axes: Any, by_rank: dict[int, list[Event]], ranks: int, step: float) -> None:
    """More actions on a rank than the picture has pixel columns: each column of each rank's
    row in the colour of the kind (and shade) that fills most of its time, faded to white by
    the share of it that is idle, so the bubbles show as they are. Drawing hundreds of
    thousands of sub-pixel bars took seconds and showed only their white edges."""
    import numpy as np
    from matplotlib.colors import to_rgb

    shades = [(kind, light) for kind in _COLOURS for light in (False, True)]
    index = {shade: i for i, shade in enumerate(shades)}
    scale = _COLUMNS / step
    spans = [(rank, index[(event.action.kind, _lighter(event, ranks))], event.start * scale, event.end * scale)
             for rank, events in by_rank.items() for event in events]
    filled = _coverage(np.array(spans, dtype=float).reshape(-1, 4), (ranks, _COLUMNS, len(shades)))
    colours = np.array([[c + (1 - c) * (1 - _LIGHT_ALPHA) if light else c for c in to_rgb(_COLOURS[kind])]
                        for kind, light in shades])  # the lighter shade as the bars' alpha on white
    busy = np.clip(filled.sum(axis=2, keepdims=True), 0.0, 1.0)
    image = 1.0 - busy * (1.0 - colours[filled.argmax(axis=2)])
    axes.imshow(image, extent=(0, step, ranks - 0.5, -0.5), aspect="auto", interpolation="nearest")


def _coverage(spans: Any, shape: tuple[int, int, int]) -> Any:
    """``filled[rank, column, shade]``: how much of each pixel column each shade's spans cover,
    from rows ``(rank, shade, first, last)`` in columns (a span's first and last column in part,
    those between whole), for a million spans at numpy's pace."""
    import numpy as np

    ranks, columns, shades = shape
    rank, shade = spans[:, 0].astype(int), spans[:, 1].astype(int)
    first, last = spans[:, 2], np.minimum(spans[:, 3], columns)
    keep = last > first
    rank, shade, first, last = rank[keep], shade[keep], first[keep], last[keep]
    head = np.minimum(first.astype(int), columns - 1)  # the column the span starts in
    tail = np.floor(last).astype(int)  # the column it ends in, ``columns`` where it ends at the edge
    filled = np.zeros(shape)
    alone = tail <= head  # begins and ends in one column
    np.add.at(filled, (rank[alone], head[alone], shade[alone]), last[alone] - first[alone])
    rank, shade, first, last, head, tail = (a[~alone] for a in (rank, shade, first, last, head, tail))
    np.add.at(filled, (rank, head, shade), head + 1 - first)
    ends_inside = tail < columns
    np.add.at(filled, (rank[ends_inside], tail[ends_inside], shade[ends_inside]),
              last[ends_inside] - tail[ends_inside])
    whole = np.zeros((ranks, columns + 1, shades))  # +1 from the column after the head, -1 from the tail
    np.add.at(whole, (rank, head + 1, shade), 1.0)
    np.add.at(whole, (rank, tail, shade), -1.0)
    return filled + np.cumsum(whole, axis=1)[:, :columns]


def write_schedule_csv(schedule: Schedule, path: str | Path) -> None:
    """Write ``schedule`` in torch.distributed.pipelining's CSV form: row r holds rank r's
    actions. Ranks with no actions get an empty row so that row numbers stay rank numbers."""
    rows = max(schedule) + 1 if schedule else 0
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        for rank in range(rows):
            writer.writerow([str(action) for action in schedule.get(rank, [])])


def read_schedule_csv(path: str | Path) -> Schedule:
    """Read a schedule CSV (ours or torch's ``_dump_csv``); empty cells are skipped."""
    with open(path, newline="") as file:
        return {
            rank: [Action.parse(cell) for cell in row if cell.strip()]
            for rank, row in enumerate(csv.reader(file))
        }
