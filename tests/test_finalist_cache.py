"""What a search's finalists measured here is kept (`autopart.profiling.finalist_cache`): a
second compile of the same plans launches nothing, ``--run-finalists`` runs them afresh, and a
failed launch, another plan or an unreadable file measures again."""

import json
import time
from dataclasses import replace

import pytest

from autopart import driver
from autopart.profiling import finalist_cache
from autopart.profiling import finalists as finalists_module
from autopart.profiling.finalists import run_finalists
from autopart.solve.planner import plan_by_search
from autopart.tools.cli import main as cli_main
from autopart.tools.local_run import LocalRunError
from tests.test_finalists import SEARCH, TINY_GPT, options


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def finalists():
    """A search's finalists at world size 2 (data parallelism over the ZeRO levels)."""
    found = plan_by_search(options(**dict(SEARCH, run_finalists=None)), plan_every=True).finalists
    assert len(found) >= 3
    return found


def steps_by_row(times: dict[int, float]):
    """A run(finalist) giving each row's step, and the rows it was called for."""
    called: list[int] = []

    def run(finalist) -> float:
        called.append(finalist.row)
        if times[finalist.row] is None:
            raise LocalRunError("the distributed run failed (exit 1):\nout of memory")
        return times[finalist.row]

    return run, called


def unsearched(plan):
    """``plan`` without its search's record (which says how its steps were had, and how long it took)."""
    return replace(plan, provenance=replace(plan.provenance, search={}))


def test_a_plan_s_key_is_its_decisions_not_its_predictions(finalists):
    plan = finalists[0].plan
    key = finalist_cache.finalist_key(plan, "cpu")
    quicker = replace(plan, predicted=replace(plan.predicted, step_s=plan.predicted.step_s / 2),
                      stages=tuple(replace(stage, forward_s=stage.forward_s * 2) for stage in plan.stages))
    assert finalist_cache.finalist_key(quicker, "cpu") == key
    assert finalist_cache.finalist_key(replace(plan, zero=(plan.zero + 1) % 4), "cpu") != key
    other = replace(plan.provenance, model_sha256="0" * 64)
    assert finalist_cache.finalist_key(replace(plan, provenance=other), "cpu") != key
    assert len({finalist_cache.finalist_key(f.plan, "cpu") for f in finalists}) == len(finalists)


def test_a_second_compile_reads_the_steps_back_and_launches_nothing(finalists):
    times = {f.row: 0.020 - 0.001 * f.row for f in finalists}  # the last row runs fastest
    run, called = steps_by_row(times)
    first, _ = run_finalists(finalists, kind="cpu", run=run)
    assert sorted(set(called)) == [f.row for f in finalists] and not first.provenance.search["from_cache"]
    called.clear()
    again, _ = run_finalists(finalists, kind="cpu", run=run)
    search = again.provenance.search
    assert called == [] and search["from_cache"] and search["chosen_by"] == "run"
    assert unsearched(again) == unsearched(first) and search["ranked"] == first.provenance.search["ranked"]
    assert search["ran_at"] == first.provenance.search["ran_at"]
    assert search["ranked"][0]["measured_step_s"] == min(times.values())


def test_asked_they_run_afresh_and_what_they_measure_is_kept(finalists):
    run, called = steps_by_row({f.row: 0.010 + 0.001 * f.row for f in finalists})
    run_finalists(finalists, kind="cpu", run=run)
    slower_first, called_again = steps_by_row({f.row: 0.030 if f.row == 0 else 0.010 for f in finalists})
    fresh, _ = run_finalists(finalists, kind="cpu", fresh=True, run=slower_first)
    assert called_again and not fresh.provenance.search["from_cache"]
    read, _ = run_finalists(finalists, kind="cpu", run=slower_first)
    assert read.provenance.search["from_cache"] and unsearched(read) == unsearched(fresh)  # the fresh figures
    assert read.provenance.search["ranked"][0]["layout"] != finalists[0].plan.provenance.search["ranked"][0]["layout"]


def test_a_failed_launch_is_not_kept_so_they_run_again(finalists):
    run, called = steps_by_row({f.row: None if f.row == 1 else 0.010 for f in finalists})
    run_finalists(finalists, kind="cpu", run=run)
    called.clear()
    plan, _ = run_finalists(finalists, kind="cpu", run=run)
    assert called and not plan.provenance.search["from_cache"]


def test_a_plan_that_failed_last_runs_again_whatever_an_earlier_run_kept(finalists):
    run, _ = steps_by_row({f.row: 0.010 for f in finalists})
    run_finalists(finalists, kind="cpu", run=run)
    second_fails, _ = steps_by_row({f.row: None if f.row == 1 else 0.010 for f in finalists})
    run_finalists(finalists, kind="cpu", fresh=True, run=second_fails)
    run, called = steps_by_row({f.row: 0.010 for f in finalists})
    plan, _ = run_finalists(finalists, kind="cpu", run=run)
    assert called and not plan.provenance.search["from_cache"]
    assert all(row["measured_step_s"] == 0.010 and "error" not in row for row in plan.provenance.search["ranked"])


def test_steps_of_different_runs_are_not_judged_together(finalists):
    """Two compiles whose finalists overlap: the second's set is all in the cache, from two runs."""
    run, called = steps_by_row({f.row: 0.010 for f in finalists})
    run_finalists(finalists[:2], kind="cpu", run=run)
    time.sleep(0.01)
    run_finalists((finalists[0], *finalists[2:]), kind="cpu", run=run)  # the first carries the search's rows
    called.clear()
    plan, _ = run_finalists(finalists, kind="cpu", run=run)
    assert sorted(set(called)) == [f.row for f in finalists] and not plan.provenance.search["from_cache"]


def test_without_a_kind_nothing_is_kept(finalists, tmp_path):
    run, called = steps_by_row({f.row: 0.010 for f in finalists})
    run_finalists(finalists, run=run)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"k": {"steps_s": [-1], "at": 0}}', '{"k": 3}'])
def test_an_unreadable_cache_is_measured_again_and_written_anew(finalists, text):
    run, called = steps_by_row({f.row: 0.010 for f in finalists})
    run_finalists(finalists, kind="cpu", run=run)
    path = finalist_cache.cache_path(finalists[0].plan, "cpu")
    written = json.loads(path.read_text())
    assert all(record["steps_s"] == [0.010] * len(record["steps_s"]) for record in written.values())
    path.write_text(text)
    called.clear()
    plan, _ = run_finalists(finalists, kind="cpu", run=run)
    assert called and not plan.provenance.search["from_cache"]
    assert len(json.loads(path.read_text())) == len(finalists)


@pytest.mark.parametrize("record", [
    {"steps_s": [0.010], "at": float("inf")}, {"steps_s": [0.010], "at": float("nan")}, {"steps_s": [0.010], "at": 1e300},
    {"steps_s": [0.010], "at": True}, {"steps_s": [float("inf")], "at": 0}, {"steps_s": [], "at": 0},
    {"steps_s": "0.01", "at": 0}, {"at": 0},
])
def test_a_record_not_well_formed_is_left_out(finalists, record):
    run, called = steps_by_row({f.row: 0.010 for f in finalists})
    run_finalists(finalists, kind="cpu", run=run)
    path = finalist_cache.cache_path(finalists[0].plan, "cpu")
    written = json.loads(path.read_text())
    written[finalist_cache.finalist_key(finalists[0].plan, "cpu")] = record  # under a key that is read
    path.write_text(json.dumps(written))
    called.clear()
    plan, _ = run_finalists(finalists, kind="cpu", run=run)
    assert called and not plan.provenance.search["from_cache"]


def test_a_file_nested_past_the_parser_s_depth_is_taken_as_empty(finalists):
    path = finalist_cache.cache_path(finalists[0].plan, "cpu")
    path.parent.mkdir(parents=True)
    path.write_text("[" * 100_000)
    run, called = steps_by_row({f.row: 0.010 for f in finalists})
    run_finalists(finalists, kind="cpu", run=run)
    assert called and len(json.loads(path.read_text())) == len(finalists)


def test_a_cache_that_cannot_be_written_costs_the_compile_nothing(finalists, tmp_path, monkeypatch, caplog):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "a-file"))
    run, called = steps_by_row({f.row: 0.010 + 0.001 * f.row for f in finalists})
    plan, _ = run_finalists(finalists, kind="cpu", run=run)
    assert plan.provenance.search["chosen_by"] == "run" and "could not keep the finalists' steps" in caplog.text


def test_the_command_line_says_the_steps_were_read_back(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(driver, "finalists_run_here", lambda options: True)  # the suite measures nothing
    run, called = steps_by_row({row: 0.010 + 0.001 * row for row in range(8)})
    monkeypatch.setattr(finalists_module, "finalist_step_s", run)
    argv = ["compile", str(TINY_GPT), "--world-size", "2", "--global-batch-size", "8", "--pp", "1", "--tp", "1",
            "--schedule", "1f1b", "--recompute", "none", "--microbatches", "2", "--time-limit", "5"]
    cli_main([*argv, "-o", str(tmp_path / "a")])
    first = capsys.readouterr().out
    assert called and "read back" not in first
    called.clear()
    cli_main([*argv, "-o", str(tmp_path / "b")])
    again = " ".join(capsys.readouterr().out.split())
    assert called == []
    assert "the fastest of the finalists run here (read back from their run at " in again
    assert "this plan ran here at 10.000 ms a step (the fastest of the search's finalists run here at " in again
    assert "read back; --run-finalists runs them again" in again
    cli_main([*argv, "-o", str(tmp_path / "c"), "--run-finalists"])  # asked: afresh
    assert called and "read back" not in capsys.readouterr().out
