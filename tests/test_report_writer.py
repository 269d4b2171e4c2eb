"""The report written in a forked process beside the rest of the output directory
(`autopart.codegen.report.ReportWriter`): its files, its failures, and its end when the
compile stops first."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from autopart.codegen import report
from autopart.codegen.report import ReportWriter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the report is forked on Linux")


def test_it_writes_in_another_process_and_wait_returns_when_it_is_done(tmp_path, monkeypatch):
    def write(plan, out: Path) -> None:
        (out / "report.md").write_text(f"{plan} from {os.getpid()}")

    monkeypatch.setattr(report, "write_report", write)
    writer = ReportWriter("the plan", tmp_path)
    writer.wait()
    plan, pid = (tmp_path / "report.md").read_text().split(" from ")
    assert plan == "the plan" and int(pid) != os.getpid()


def test_where_it_cannot_fork_it_writes_in_this_process(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "write_report", lambda plan, out: (out / "report.md").write_text(str(os.getpid())))
    monkeypatch.setattr(sys, "platform", "darwin")
    ReportWriter("the plan", tmp_path).wait()
    assert (tmp_path / "report.md").read_text() == str(os.getpid())


def test_only_a_large_plan_s_report_is_forked():
    def plan(stages: int, microbatches: int):
        return SimpleNamespace(stages=[None] * stages, schedule=SimpleNamespace(microbatches=microbatches))

    assert not report.report_forks(plan(2, 4))  # the quickstart's: drawn at once
    assert report.report_forks(plan(128, 1024))  # 393k actions
    assert report.report_forks(plan(8, -(-report.FORK_FROM_ACTIONS // 24)))


def test_its_error_reaches_the_compile(tmp_path, monkeypatch):
    def write(plan, out: Path) -> None:
        raise ValueError("no timeline for a plan of no stages")

    monkeypatch.setattr(report, "write_report", write)
    with pytest.raises(RuntimeError, match=r"(?s)writing the report .* failed:.*Traceback.*"
                                           r"ValueError: no timeline for a plan of no stages"):
        ReportWriter("the plan", tmp_path).wait()


def test_a_death_without_a_word_is_an_error_too(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "write_report", lambda plan, out: os._exit(3))
    with pytest.raises(RuntimeError, match="its process ended with code 3"):
        ReportWriter("the plan", tmp_path).wait()


def test_stop_ends_it_before_its_folder_goes(tmp_path, monkeypatch):
    def write(plan, out: Path) -> None:
        time.sleep(60)
        (out / "late.md").write_text("written after the folder was given up")

    monkeypatch.setattr(report, "write_report", write)
    writer = ReportWriter("the plan", tmp_path)
    started = time.monotonic()
    writer.stop()
    assert time.monotonic() - started < 10 and not (tmp_path / "late.md").exists()
    writer.wait()  # stopped: nothing left to wait for


@pytest.mark.parametrize("forked", [False, True])
def test_a_report_that_fails_leaves_no_output_directory_and_nothing_beside_it(forked, tmp_path, monkeypatch):
    from autopart.tools import cli
    from tests.distributed import REPO

    def write(plan, out: Path) -> None:
        (out / "report.md").write_text("half")
        raise OSError("no space left on device")

    monkeypatch.setattr(report, "write_report", write)
    if forked:  # the quickstart's plan is small: its report is written in this process unless told
        monkeypatch.setattr(report, "FORK_FROM_ACTIONS", 0)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError if forked else OSError, match="no space left on device"):
        cli.main(["compile", str(REPO / "examples" / "gpt.py"), "-o", str(out), "--pp", "2", "--microbatches", "2",
                  "--time-limit", "5"])
    assert list(tmp_path.iterdir()) == []
