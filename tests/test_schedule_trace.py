"""Timelines come out as Chrome traces, Gantt PNGs and torch-style CSVs, and read back."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from autopart.ir.errors import ScheduleError
from autopart.schedule import (
    Action,
    StageCosts,
    add_communication,
    build_schedule,
    chrome_trace_events,
    read_chrome_trace,
    read_schedule_csv,
    simulate,
    write_chrome_trace,
    write_gantt_png,
    write_schedule_csv,
)


@pytest.fixture(scope="module")
def timeline():
    schedule = add_communication(build_schedule("zb-h1", ranks=3, microbatches=4), ranks=3)
    costs = StageCosts.uniform(
        3, forward_s=0.010, backward_s=0.020, weight_s=0.008, transfer_s=0.001
    )
    return simulate(schedule, costs, ranks=3)


def test_chrome_trace_fields(timeline, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    write_chrome_trace(timeline, path, title="zb-h1")
    document = json.loads(path.read_text())
    spans = [e for e in document["traceEvents"] if e["ph"] == "X"]
    names = {
        e["tid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"
    }
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    assert len(spans) == len(timeline.events) == 3 * 4 * 3  # F, I and W per stage and microbatch
    first = next(e for e in spans if e["name"] == "1F0")
    event = next(e for e in timeline.events if str(e.action) == "1F0")
    assert (first["pid"], first["tid"]) == (0, 1)
    assert first["ts"] == pytest.approx(event.start * 1e6)
    assert first["dur"] == pytest.approx((event.end - event.start) * 1e6)
    assert spans == [e for e in chrome_trace_events(timeline) if e["ph"] == "X"]


def test_chrome_trace_round_trip(timeline, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    write_chrome_trace(timeline, path)
    back = read_chrome_trace(path)
    assert back.step_s == pytest.approx(timeline.step_s)
    assert back.bubble == pytest.approx(timeline.bubble)
    assert back.peak_in_flight == timeline.peak_in_flight
    assert [(e.rank, e.action) for e in back.events] == [
        (e.rank, e.action) for e in timeline.events
    ]
    assert [e.start for e in back.events] == pytest.approx([e.start for e in timeline.events])
    assert [e.end for e in back.events] == pytest.approx([e.end for e in timeline.events])


@pytest.mark.parametrize("seed", range(4))
def test_the_trace_file_is_each_event_as_json_writes_it(tmp_path: Path, seed: int) -> None:
    # complete events are formatted by hand for speed: byte for byte what json.dumps writes,
    # odd floats (tiny, huge, exponents) and a title that json must escape included
    import random

    from autopart.schedule import Event, Timeline

    rng = random.Random(seed)
    schedule = build_schedule("1f1b", ranks=2, microbatches=3)
    events = [Event(rank=rank, action=action, start=start, end=start + rng.choice([0.0, 1e-9, 3.3e-5, 12345.678]))
              for rank, actions in schedule.items() for action, start in
              zip(actions, sorted(rng.uniform(0, 10) ** rng.choice([1, 5, -1]) for _ in actions))]
    if seed == 0:  # a time json writes as Infinity: written by json itself
        events[-1] = events[-1]._replace(end=math.inf)
    timeline = Timeline.from_events(events, ranks=2)
    title = 'a "model", \\ é }, {'  # the process's name: written by json
    write_chrome_trace(timeline, tmp_path / "t.json", title=title)
    expected = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}, *chrome_trace_events(timeline)]
    text = (tmp_path / "t.json").read_text()
    assert text.startswith('{"traceEvents": [\n' + ",\n".join(json.dumps(e) for e in expected) + "\n],")
    if seed:
        assert json.loads(text)["traceEvents"] == expected


def test_reads_a_measured_trace(tmp_path: Path) -> None:
    # The runtime's clock starts anywhere and it may record spans that are not schedule actions.
    t0 = 1.7e15
    events = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "rank 1"}},
        {"name": "0F0", "ph": "X", "pid": 0, "tid": 0, "ts": t0, "dur": 1000.0},
        {"name": "0SEND_F0", "ph": "X", "pid": 0, "tid": 0, "ts": t0 + 1000, "dur": 5.0},
        {"name": "1F0", "ph": "X", "pid": 0, "tid": 1, "ts": t0 + 1500, "dur": 1000.0},
        {"name": "1B0", "ph": "X", "pid": 0, "tid": 1, "ts": t0 + 2500, "dur": 2000.0},
        {"name": "0B0", "ph": "X", "pid": 0, "tid": 0, "ts": t0 + 5000, "dur": 2000.0},
        {"name": "optimizer step", "ph": "X", "pid": 0, "tid": 0, "ts": t0 + 7000, "dur": 300.0},
    ]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(events))  # the bare-array form of the format
    measured = read_chrome_trace(path)
    assert [str(e.action) for e in measured.events] == ["0F0", "1F0", "1B0", "0B0"]
    assert measured.events[0].start == 0.0
    assert measured.step_s == pytest.approx(0.007)
    assert measured.bubble == pytest.approx(1 - 0.006 / (2 * 0.007))
    assert measured.peak_in_flight == (1, 1)


def test_unreadable_trace_raises(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ScheduleError, match="cannot read the trace"):
        read_chrome_trace(path)
    path.write_text('{"events": []}')
    with pytest.raises(ScheduleError, match="no traceEvents"):
        read_chrome_trace(path)


def test_gantt_png_is_a_real_picture(timeline, tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    write_gantt_png(timeline, path, title="zb-h1, 3 ranks")
    image = imread(path)
    height, width, _ = image.shape
    assert width >= 800 and height >= 150
    colours = np.unique((image[..., :3] * 255).round().reshape(-1, 3), axis=0)
    assert len(colours) > 20
    pixels = (image[..., :3] * 255).round().reshape(-1, 3)
    for hex_colour in ("#0072B2", "#E69F00", "#CC79A7"):  # F, I and W each get their colour
        rgb = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(pixels - rgb).max(axis=1) <= 2).sum() > 500, hex_colour


def _rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])


def test_a_pipeline_with_more_actions_than_pixels_is_drawn_by_what_fills_each_column(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    # gpipe over 2 ranks, 1,200 microbatches: rank 0 forwards for the first third of the step, then
    # idles until rank 1's first backward, then runs its backwards; rank 1 starts a forward late
    from matplotlib.axes import Axes

    costs = StageCosts.uniform(2, forward_s=1.0, backward_s=2.0)
    timeline = simulate(build_schedule("gpipe", ranks=2, microbatches=1200), costs, ranks=2)
    drawn = {}
    real_imshow = Axes.imshow

    def imshow(self, image, **kwargs):
        drawn.update(image=image, **kwargs)
        return real_imshow(self, image, **kwargs)

    monkeypatch.setattr(Axes, "imshow", imshow)
    path = tmp_path / "timeline.png"
    write_gantt_png(timeline, path)
    assert imread(path).shape[1] >= 800
    image = (drawn["image"] * 255).round()
    assert image.shape == (2, 1000, 3) and drawn["extent"] == (0, timeline.step_s, 1.5, -0.5)
    forward, backward = _rgb("#0072B2"), _rgb("#009E73")
    assert (image[0, 10] == forward).all() and (image[0, 900] == backward).all()
    idle_column = int(1201.5 / timeline.step_s * 1000)  # rank 0 waits for rank 1's first backward
    assert (image[0, idle_column] > forward).all() and (image[0, idle_column] < 255).any()
    late = image[1, 0]  # a second of 3.6 idle, then forwards: the forward colour, faded
    assert (late > forward).all() and (late < 255).all()


def test_many_ranks_share_the_picture_s_height(tmp_path: Path) -> None:
    costs = StageCosts.uniform(64, forward_s=1.0, backward_s=2.0)
    timeline = simulate(build_schedule("gpipe", ranks=64, microbatches=2), costs, ranks=64)
    path = tmp_path / "timeline.png"
    write_gantt_png(timeline, path)
    assert imread(path).shape[0] <= (1.2 + 0.5 * 32) * 100  # half an inch a rank would be 3,320 pixels


def test_schedule_csv_round_trip(tmp_path: Path) -> None:
    schedule = build_schedule("1f1b", ranks=2, microbatches=2)
    path = tmp_path / "schedule.csv"
    write_schedule_csv(schedule, path)
    assert path.read_text().splitlines() == ["0F0,0F1,0B0,0B1", "1F0,1B0,1F1,1B1"]
    assert read_schedule_csv(path) == schedule
    lowered = add_communication(schedule, ranks=2)
    write_schedule_csv(lowered, path)
    assert read_schedule_csv(path) == lowered


def test_schedule_csv_keeps_row_numbers_for_idle_ranks(tmp_path: Path) -> None:
    path = tmp_path / "schedule.csv"
    write_schedule_csv({0: [Action.parse("0F0")], 2: [Action.parse("2F0")]}, path)
    assert read_schedule_csv(path) == {0: [Action.parse("0F0")], 1: [], 2: [Action.parse("2F0")]}


@pytest.mark.parametrize("seed", range(5))
def test_each_column_holds_the_time_its_spans_cover(seed: int) -> None:
    """`trace._coverage` (numpy, for a million spans) against the span-by-span sum it stands for:
    spans inside a column, across several, ending on a column's edge or past the picture's."""
    from autopart.schedule import trace

    rng = np.random.default_rng(seed)
    ranks, columns, shades = 3, 40, 4
    spans = []
    for _ in range(300):
        first = rng.choice([rng.uniform(0, columns + 2), float(rng.integers(0, columns))])
        length = rng.choice([0.0, rng.uniform(0, 0.5), rng.uniform(0, 8), float(rng.integers(1, 4))])
        spans.append((rng.integers(ranks), rng.integers(shades), first, first + length))
    expected = np.zeros((ranks, columns, shades))
    for rank, shade, first, last in spans:
        last = min(last, columns)
        column = min(int(first), columns - 1)
        while column < last > first:
            expected[rank, column, shade] += min(last, column + 1) - max(first, column)
            column += 1
    got = trace._coverage(np.array(spans, dtype=float), (ranks, columns, shades))
    assert np.allclose(got, expected, atol=1e-9) and expected.sum() > 100
