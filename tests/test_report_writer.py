"""The report written in forked processes beside the rest of the output directory
(`autopart.codegen.report.begin_report`): its files, its failures, and its end when the
compile stops first."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from autopart.codegen import report
from autopart.codegen.report import begin_report
from autopart.schedule import stored

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the report is forked on Linux")


@pytest.fixture
def parts(monkeypatch):
    """The report's parts replaced by ``parts.set(...)`` (its timeline taken as simulated)."""
    monkeypatch.setattr(report, "plan_timeline", lambda plan: None)
    return SimpleNamespace(set=lambda *fakes: monkeypatch.setattr(
        report, "PARTS", tuple((f"part {index}", fake) for index, fake in enumerate(fakes))))


def _writes(name: str):
    def part(plan, out: Path) -> None:
        (out / name).write_text(f"{plan} from {os.getpid()}")

    return part


def test_each_part_is_written_in_a_process_of_its_own_and_wait_returns_when_all_are_done(tmp_path, parts):
    parts.set(_writes("timeline.png"), _writes("report.md"))
    begin_report("the plan", tmp_path).wait()
    written = {path.name: path.read_text().split(" from ") for path in tmp_path.iterdir()}
    assert sorted(written) == ["report.md", "timeline.png"]
    pids = {int(pid) for plan, pid in written.values()}
    assert {plan for plan, pid in written.values()} == {"the plan"} and len(pids) == 2 and os.getpid() not in pids


def test_where_it_cannot_fork_it_writes_in_this_process(tmp_path, parts, monkeypatch):
    parts.set(_writes("timeline.png"), _writes("report.md"))
    monkeypatch.setattr(sys, "platform", "darwin")
    begin_report("the plan", tmp_path).wait()
    assert {path.read_text() for path in tmp_path.iterdir()} == {f"the plan from {os.getpid()}"}


def test_only_a_large_plan_s_report_is_forked():
    def plan(ranks: int, microbatches: int, kind: str = "1f1b", chunks: int = 1):
        return SimpleNamespace(mesh={"pp": ranks}, schedule=SimpleNamespace(kind=kind, microbatches=microbatches,
                                                                             chunks=chunks))

    assert not report.report_forks(plan(2, 4))  # the quickstart's: drawn at once
    assert report.report_forks(plan(128, 1024))  # 262k compute actions
    least = stored.FORK_FROM_ACTIONS // 16  # 8 ranks, 2 compute actions per stage and microbatch
    assert report.report_forks(plan(8, least)) and not report.report_forks(plan(8, least - 1))
    assert report.report_forks(plan(8, -(-least * 2 // 3), "zb-h1"))  # 3: W apart
    assert report.report_forks(plan(4, least, "interleaved", chunks=2))


def test_its_error_reaches_the_compile(tmp_path, parts):
    def fails(plan, out: Path) -> None:
        raise ValueError("no timeline for a plan of no stages")

    parts.set(_writes("timeline.png"), fails)
    with pytest.raises(RuntimeError, match=r"(?s)^writing the report's part 1 failed:.*Traceback.*"
                                           r"ValueError: no timeline for a plan of no stages"):
        begin_report("the plan", tmp_path).wait()


def test_a_death_without_a_word_is_an_error_too(tmp_path, parts):
    parts.set(lambda plan, out: os._exit(3), _writes("report.md"))
    with pytest.raises(RuntimeError, match="^writing the report's part 0 failed: its process ended with code 3$"):
        begin_report("the plan", tmp_path).wait()


def test_stop_ends_every_part_before_its_folder_goes(tmp_path, parts):
    def slow(name: str):
        def part(plan, out: Path) -> None:
            time.sleep(60)
            (out / name).write_text("written after the folder was given up")

        return part

    parts.set(slow("timeline.png"), slow("report.md"))
    writer = begin_report("the plan", tmp_path)
    started = time.monotonic()
    writer.stop()
    assert time.monotonic() - started < 10 and list(tmp_path.iterdir()) == []
    writer.wait()  # stopped: nothing left to wait for


@pytest.mark.parametrize("forked", [False, True])
def test_a_report_that_fails_leaves_no_output_directory_and_nothing_beside_it(forked, tmp_path, monkeypatch):
    from autopart.tools import cli
    from tests.distributed import REPO

    def write(plan, out: Path) -> None:
        (out / "report.md").write_text("half")
        raise OSError("no space left on device")

    monkeypatch.setattr(report, "PARTS", (report.PARTS[0], ("report.md", write)))
    if forked:  # the quickstart's plan is small: its report is written in this process unless told
        monkeypatch.setattr(stored, "FORK_FROM_ACTIONS", 0)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError if forked else OSError, match="no space left on device"):
        cli.main(["compile", str(REPO / "examples" / "gpt.py"), "-o", str(out), "--pp", "2", "--microbatches", "2",
                  "--time-limit", "5"])
    assert list(tmp_path.iterdir()) == []
