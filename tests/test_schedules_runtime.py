"""The runtime runs interleaved 1F1B, ZB-H1 and ZB-V as it runs GPipe and 1F1B: the same losses and
final parameters as one process (test_pipeline_equivalence.py covers gpipe and 1f1b), and a
measured step (``train.py --trace``) that runs every rank's actions in the simulated order.

Each launch trains for 2 steps with 1 sample per microbatch and writes a trace of its last step,
and every check on it reads that one launch: equivalence, the measured order, the pictures of
its compile, and ``autopart explain``.
"""

import json
import re

import pytest

from autopart.tools.cli import main as cli_main
from autopart.tools.explain import stage_figures
from autopart.predict.timeline import plan_timeline
from autopart.schedule import Kind, read_chrome_trace
from tests.distributed import Trained, assert_same_training, compile_and_train, run_cli_here

pytestmark = pytest.mark.multiprocess

CASES = [
    (example, pp, schedule)
    for example in ("gpt", "llama")
    for pp in (2, 4)
    for schedule in ("interleaved", "zb-h1", "zbv")
]
_CHUNKS = {"interleaved": 2, "zbv": 2}
_RUNS: dict[tuple[str, int, str], Trained] = {}


def trained(tmp_path_factory, example: str, pp: int, schedule: str) -> Trained:
    """One launch per case, shared by the tests that read it."""
    key = (example, pp, schedule)
    if key not in _RUNS:
        _RUNS[key] = compile_and_train(
            tmp_path_factory.mktemp(f"{example}-{pp}-{schedule}"), example, pp=pp, microbatches=2 * pp,
            schedule=schedule, chunks=_CHUNKS.get(schedule, 1), steps=2, micro_batch_size=1, trace=True,
        )  # fmt: skip
    return _RUNS[key]


def _ids(case):
    return "-".join(map(str, case))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_schedule_trains_like_one_process(tmp_path_factory, case):
    example, pp, schedule = case
    run = trained(tmp_path_factory, *case)
    chunks = _CHUNKS.get(schedule, 1)
    if schedule == "zbv":  # down the ranks and back up: the loss is on rank 0 with the first stage
        assert [s.rank for s in run.plan.stages] == [*range(pp), *reversed(range(pp))]
    else:
        assert [s.rank for s in run.plan.stages] == [s % pp for s in range(pp * chunks)]
    if example == "gpt":  # the tied embedding sits on the first and the last stage, on two ranks
        assert run.plan.tied_parameters == {"wte.weight": (0, pp * chunks - 1)}
    assert_same_training(run, optimizer="sgd", lr=0.1)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_measured_step_runs_in_the_simulated_order(tmp_path_factory, case):
    run = trained(tmp_path_factory, *case)
    measured = read_chrome_trace(run.trace)
    simulated = plan_timeline(run.plan)
    measured_order = {r: [str(e.action) for e in events] for r, events in measured.per_rank().items()}
    simulated_order = {r: [str(e.action) for e in events] for r, events in simulated.per_rank().items()}
    assert measured_order == simulated_order
    if case[2] in ("zb-h1", "zbv"):
        assert any(e.action.kind is Kind.W for e in measured.events)
    for events in measured.per_rank().values():  # one action at a time on a rank, all of positive length
        assert all(e.end > e.start for e in events)
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))
    assert measured.step_s > 0 and 0 <= measured.bubble < 1


def test_stages_on_one_rank_hand_over_in_memory(tmp_path):
    """Interleaved on one rank: both chunks, and both copies of the tied embedding, on rank 0."""
    run = compile_and_train(tmp_path, "gpt", pp=1, microbatches=2, schedule="interleaved", chunks=2,
                            steps=2, micro_batch_size=1)  # fmt: skip
    assert [s.rank for s in run.plan.stages] == [0, 0]
    assert run.plan.tied_parameters == {"wte.weight": (0, 1)}
    assert_same_training(run, optimizer="sgd", lr=0.1)


def _colour_pixels(image, hex_colour: str) -> int:
    rgb = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return int((abs(image[..., :3] - rgb).max(axis=-1) < 0.02).sum())


def test_compile_draws_the_timeline_and_writes_a_chrome_trace(tmp_path_factory):
    from matplotlib.image import imread

    run = trained(tmp_path_factory, "gpt", 2, "zb-h1")
    assert (run.out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(run.out / "timeline.png")
    assert image.shape[0] > 100 and image.shape[1] > 500
    for colour in ("#0072B2", "#E69F00", "#CC79A7"):  # F, I and W bars of both ranks
        assert _colour_pixels(image, colour) > 500, colour
    document = json.loads((run.out / "trace.json").read_text())
    spans = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert all({"name", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] > 0 for e in spans)
    assert {e["tid"] for e in spans} == {0, 1}
    predicted = plan_timeline(run.plan)
    assert sorted(e["name"] for e in spans) == sorted(str(e.action) for e in predicted.events)
    assert read_chrome_trace(run.out / "trace.json").step_s == pytest.approx(predicted.step_s)


def test_explain_sets_a_measured_step_beside_the_prediction(tmp_path_factory):
    run = trained(tmp_path_factory, "gpt", 2, "zb-h1")
    result = run_cli_here("explain", str(run.out), "--trace", str(run.trace))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for header in ("blocks", "params MB", "memory GiB", "predicted ms", "measured ms", "error"):
        assert header in text
    rows = [[c.strip() for c in re.split("[│|]", line)[1:-1]] for line in text.splitlines()]
    measured = stage_figures(read_chrome_trace(run.trace))
    for stage in run.plan.stages:  # the figures printed are the plan's and the trace's, per stage
        figures = {row[2]: row[3:] for row in rows if len(row) == 6 and row[:2] == [str(stage.index), str(stage.rank)]}
        assert figures["forward"][0] == f"{stage.forward_s * 1e3:.3f}"
        assert figures["forward"][1] == f"{measured[stage.index].forward_s * 1e3:.3f}"
        assert figures["backward"][1] == f"{measured[stage.index].backward_s * 1e3:.3f}"
        assert set(figures) == {"forward", "backward", "per step"}
    assert "pipeline (the trace's span: forwards, backwards, transfers): predicted" in text and "bubble: predicted" in text
    pipeline = plan_timeline(run.plan).step_s  # the plan's step says what it adds beyond the traced pipeline
    assert f"the predicted step of {run.plan.predicted.step_s * 1e3:.3f} ms adds " \
           f"{(run.plan.predicted.step_s - pipeline) * 1e3:.3f} ms to the pipeline" in " ".join(text.split())


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/missing"], "output directory '.*missing' does not exist"),
        (["{tmp}"], "is not an autopart output directory"),
        (["{out}", "--trace", "{tmp}/bad.json"], "cannot read the trace .*bad.json"),
        (["{out}", "--trace", "{other}"], "is not a step of this plan"),
    ],
    ids=["missing-out", "not-autopart", "bad-trace", "other-plan"],
)
def test_explain_errors_are_one_line_exit_2(tmp_path_factory, tmp_path, capsys, args, message):
    out = trained(tmp_path_factory, "gpt", 2, "zb-h1").out
    (tmp_path / "bad.json").write_text("{ not json")
    other = trained(tmp_path_factory, "gpt", 2, "interleaved").out / "trace.json"  # the prediction of another plan
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["explain", *(a.format(tmp=tmp_path, out=out, other=other) for a in args)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopart: error: ")
    assert re.search(message, err[0]), err[0]


def test_explain_and_the_timeline_show_the_v(tmp_path_factory):
    run = trained(tmp_path_factory, "gpt", 2, "zbv")
    result = run_cli_here("explain", str(run.out), "--trace", str(run.trace))
    assert result.returncode == 0, result.stderr
    rows = [[c.strip() for c in re.split("[│|]", line)[1:-1]] for line in result.stdout.splitlines()]
    ranks = {int(row[0]): int(row[1]) for row in rows if len(row) >= 2 and row[0].isdigit() and row[1].isdigit()}
    assert ranks == {0: 0, 1: 1, 2: 1, 3: 0}  # the V: the loss's stage back on rank 0
    assert "zbv" in result.stdout
    document = json.loads((run.out / "trace.json").read_text())
    names = {e["name"] for e in document["traceEvents"] if e["ph"] == "X"}
    assert {"3W0", "0I0", "2F0"} <= names  # both chunks of each rank, their backwards split
    assert (run.out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
