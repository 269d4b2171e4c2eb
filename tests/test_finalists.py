"""A search on the machine at hand runs its finalists here and keeps the fastest
(`autopart.profiling.finalists`): when it does, how it judges the runs, and a real search."""

import json
from pathlib import Path

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.errors import ConfigError
from autopart.profiling import finalists as finalists_module
from autopart.profiling import measure_defaults
from autopart.profiling.finalists import CLOSE, chosen_by_running, finalists_run_here
from autopart.profiling.measure_defaults import NO_MEASURE_ENV
from autopart.tools.cli import main as cli_main

TINY_GPT = Path(__file__).parent / "models" / "tiny_gpt.py"


def runs_of(times: dict[int, list[float]]):
    """A run(index) giving each finalist's listed times in turn, and the order it was called in."""
    called: list[int] = []
    left = {index: list(seconds) for index, seconds in times.items()}

    def run(index: int) -> float:
        called.append(index)
        return left[index].pop(0)

    return run, called


def test_the_fastest_run_is_kept_not_the_first_predicted():
    run, called = runs_of({0: [0.030], 1: [0.020], 2: [0.050]})
    chosen, measured = chosen_by_running(3, run)
    assert chosen == 1
    assert called == [0, 1, 2]  # none came within CLOSE of the fastest: nothing ran again
    assert measured == {0: [0.030], 1: [0.020], 2: [0.050]}


def test_close_finalists_run_again_in_reverse_order_and_are_judged_by_their_median():
    # 0 ran fastest once, but its second run is slow; 2 is steady
    run, called = runs_of({0: [0.0200, 0.0300], 1: [0.0400], 2: [0.0210, 0.0215]})
    chosen, measured = chosen_by_running(3, run)
    assert called == [0, 1, 2, 2, 0]
    assert chosen == 2
    assert measured[0] == [0.0200, 0.0300] and measured[1] == [0.0400]


def test_close_means_within_the_band_of_the_fastest():
    edge = 0.020 * (1 + CLOSE)
    run, called = runs_of({0: [0.020, 0.020], 1: [edge * 0.999, 0.05], 2: [edge * 1.01]})
    chosen_by_running(3, run)
    assert called == [0, 1, 2, 1, 0]


def test_equal_runs_keep_the_better_predicted():
    run, _ = runs_of({0: [0.02, 0.02], 1: [0.02, 0.02]})
    assert chosen_by_running(2, run)[0] == 0


def test_where_none_ran_none_runs_again_and_the_first_is_kept():
    inf = float("inf")
    run, called = runs_of({0: [inf], 1: [inf], 2: [inf]})
    assert chosen_by_running(3, run)[0] == 0
    assert called == [0, 1, 2]


def test_progress_hears_every_run():
    run, _ = runs_of({0: [0.02, 0.02], 1: [0.021, 0.021], 2: [0.09]})
    heard = []
    chosen_by_running(3, run, lambda done, total: heard.append((done, total)))
    assert heard == [(0, 3), (1, 3), (2, 3), (3, 3), (4, 5), (5, 5)]


def options(**changes) -> CompileOptions:
    return CompileOptions(**{"model": TINY_GPT, "world_size": 2, "global_batch_size": 8, **changes})


def test_by_default_only_where_measuring_is_on(monkeypatch):
    monkeypatch.delenv(NO_MEASURE_ENV, raising=False)
    assert finalists_run_here(options())
    assert not finalists_run_here(options(measure=False))
    assert not finalists_run_here(options(run_finalists=False))
    monkeypatch.setenv(NO_MEASURE_ENV, "1")
    assert not finalists_run_here(options())
    assert finalists_run_here(options(run_finalists=True))  # asked: the suite's setting does not matter
    assert not finalists_run_here(CompileOptions(model=TINY_GPT, pp=2))  # nothing searched


def test_not_where_the_ranks_cannot_run_here(monkeypatch):
    monkeypatch.delenv(NO_MEASURE_ENV, raising=False)
    assert not finalists_run_here(options(device="a100-80gb"))
    assert not finalists_run_here(options(world_size=4, gpus_per_node=2))
    monkeypatch.setattr(measure_defaults, "usable_cores", lambda: 1)  # where the ranks' test reads it
    assert finalists_run_here(options(world_size=2))  # by default up to two ranks per core
    assert not finalists_run_here(options(world_size=4))
    assert finalists_run_here(options(world_size=4, run_finalists=True))  # asked, up to four
    with pytest.raises(ConfigError, match="more than 4 ranks per core of its 1"):
        finalists_run_here(options(world_size=8, run_finalists=True))


@pytest.mark.parametrize("changes, named", [
    (dict(device="a100-80gb"), "--device a100-80gb is not this machine's"),
    (dict(world_size=4, gpus_per_node=2), "spans more than one node of 2"),
    (dict(profile_pipeline=True, costs=Path("costs.json")), "give one of them"),
])
def test_asked_where_they_cannot_run_is_refused_in_one_line(changes, named):
    with pytest.raises(ConfigError, match=named):
        finalists_run_here(options(run_finalists=True, **changes))


def test_asked_without_a_search_is_refused():
    with pytest.raises(ConfigError, match="add --world-size"):
        CompileOptions(model=TINY_GPT, pp=2, run_finalists=True)


def test_the_command_line_refuses_it_with_exit_2(capsys):
    with pytest.raises(SystemExit) as ended:
        cli_main(["compile", str(TINY_GPT), "-o", "unused", "--pp", "2", "--run-finalists"])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--run-finalists runs a search's finalists" in err[0]


def test_the_command_line_refuses_before_it_searches(capsys, monkeypatch):
    from autopart.solve import planner

    monkeypatch.setattr(planner, "search_space", lambda options: pytest.fail("the search ran"))
    with pytest.raises(SystemExit) as ended:
        cli_main(["compile", str(TINY_GPT), "-o", "unused", "--world-size", "2", "--global-batch-size", "8",
                  "--device", "a100-80gb", "--run-finalists"])
    assert ended.value.code == 2
    assert "--device a100-80gb is not this machine's" in capsys.readouterr().err


def layout_of(plan) -> str:
    """``plan``'s layout as the search's rows write it (`autopart.solve.search.Layout.describe`)."""
    schedule = plan.schedule.kind + (f" v={plan.schedule.chunks}" if plan.schedule.chunks > 1 else "")
    zero = {0: "", 1: " zero"}.get(plan.zero, f" zero{plan.zero}")
    return (f"pp{plan.mesh['pp']} tp{plan.mesh['tp']} dp{plan.mesh['dp']} {plan.schedule.microbatches}x"
            f"{plan.schedule.micro_batch_size} {schedule}{zero}" + (f" {plan.dtype}" if plan.dtype != "fp32" else ""))


SEARCH = dict(run_finalists=True, pp=1, tp=1, schedule="1f1b", recompute="none", microbatches=2, dtype="fp32",
              time_limit_s=5)
"""A search at world size 2 pinned to data parallelism over the ZeRO levels: a few finalists, one front."""


def test_the_finalist_that_ran_fastest_is_the_one_emitted(tmp_path, monkeypatch):
    """Made so that the last finalist runs fastest: it is the plan, its row comes first, and the
    directory written is its programs'."""
    runs = []

    def last_fastest(finalist):
        runs.append(finalist.row)
        return 0.010 if finalist.row == 3 else 0.020

    monkeypatch.setattr(finalists_module, "finalist_step_s", last_fastest)
    plan, out = compile_to_directory(options(**SEARCH), tmp_path / "out")
    search = plan.provenance.search
    assert sorted(set(runs)) == [0, 1, 2, 3] and search["chosen_by"] == "run"  # ZeRO 0 to 3
    ranked = search["ranked"]
    assert ranked[0]["layout"] == layout_of(plan) and ranked[0]["measured_step_s"] == 0.010
    assert [row["measured_step_s"] for row in ranked[1:]] == [0.020] * 3
    assert plan.provenance.solver_status == "trivial"  # one stage; not the first finalist's refined status
    written = json.loads((out / "plan.json").read_text())
    assert written["zero"] == plan.zero and written["provenance"]["search"]["ranked"][0] == ranked[0]
    assert plan.zero != compile_to_directory(options(**dict(SEARCH, run_finalists=False)), tmp_path / "o2")[0].zero


def test_a_finalist_that_fails_to_run_is_left_out_and_said(tmp_path, monkeypatch, caplog):
    from autopart.tools.local_run import LocalRunError

    def first_fails(finalist):
        if finalist.row == 0:
            raise LocalRunError("the distributed run failed (exit 1):\nautopart: error: out of memory")
        return 0.010 + finalist.row * 1e-3

    monkeypatch.setattr(finalists_module, "finalist_step_s", first_fails)
    plan, _ = compile_to_directory(options(**SEARCH), tmp_path / "out")
    ranked = plan.provenance.search["ranked"]
    assert ranked[0]["measured_step_s"] == 0.011 and ranked[0]["layout"] == layout_of(plan)
    failed = [row for row in ranked if "error" in row]
    assert len(failed) == 1 and failed[0]["measured_step_s"] is None
    assert failed[0]["error"] == "the distributed run failed (exit 1):"
    assert f"the search's finalist {failed[0]['layout']} did not run here (the distributed run failed (exit 1):)" \
        in caplog.text


def test_where_no_finalist_runs_the_search_s_choice_stays(tmp_path, monkeypatch, caplog):
    from autopart.tools.local_run import LocalRunError

    def fails(finalist):
        raise LocalRunError("the distributed run did not finish within 300 s")

    monkeypatch.setattr(finalists_module, "finalist_step_s", fails)
    plan, _ = compile_to_directory(options(**SEARCH), tmp_path / "out")
    search = plan.provenance.search
    # the plan is the search's first row (not a second compile's: the step counts the machine's
    # load at each compile, and near-ties between ZeRO levels move with it)
    words = search["ranked"][0]["layout"].split()
    zero = next((w for w in words if w.startswith("zero")), "")
    assert words[:3] == [f"pp{plan.mesh['pp']}", f"tp{plan.mesh['tp']}", f"dp{plan.mesh['dp']}"]
    assert search["chosen_by"] == "search" and plan.zero == {"zero": 1, "zero2": 2, "zero3": 3}.get(zero, 0)
    assert all(row["measured_step_s"] is None for row in search["ranked"])
    assert "none of the search's finalists ran here (the distributed run did not finish within 300 s)" in caplog.text


def test_a_shallow_search_plans_every_finalist_to_run_them(tmp_path):
    """A model of many layers alike is searched through a shallow copy, which plans only the
    finalists that may win; to run them, every one is planned, each in its own row."""
    from autopart.solve import planner
    from tests.test_shallow import MODEL_FILE

    model = tmp_path / "deep.py"
    model.write_text(MODEL_FILE.format(models=str(Path(__file__).resolve().parent.parent / "benchmarks" / "models")))
    searched = planner.plan_by_search(CompileOptions(model=model, world_size=4, global_batch_size=8,
                                                     device="h100-sxm"), plan_every=True)
    rows = searched.plan.provenance.search["ranked"]
    assert len(searched.finalists) == len(rows) > 2
    assert [f.row for f in searched.finalists] == list(range(len(rows)))
    for finalist in searched.finalists:
        assert rows[finalist.row]["layout"] == layout_of(finalist.plan)
        assert rows[finalist.row]["step_s"] == finalist.plan.predicted.step_s
    assert searched.finalists[0].plan is searched.plan


@pytest.mark.multiprocess
def test_a_search_runs_its_finalists_and_emits_the_fastest(tmp_path):
    """A real search at world size 2: each finalist ran here, and the plan kept is the one that ran fastest."""
    plan, out = compile_to_directory(options(**SEARCH), tmp_path / "out")
    search = plan.provenance.search
    ranked = search["ranked"]
    assert search["chosen_by"] == "run" and search["run_seconds"] > 0
    assert len(ranked) >= 2
    steps = [row["measured_step_s"] for row in ranked]
    assert all(step > 0 for step in steps)
    assert all(row["launches"] in (1, 2) for row in ranked)
    assert steps[0] == min(steps) and ranked[0]["layout"] == layout_of(plan)
    written = json.loads((out / "plan.json").read_text())
    assert written["provenance"]["search"]["ranked"][0]["measured_step_s"] == steps[0]
    assert written["zero"] == plan.zero and written["mesh"] == plan.mesh


@pytest.mark.parametrize("cores, said", [(1, True), (2, False)])
def test_a_plan_of_more_ranks_than_cores_says_they_take_turns(tmp_path, monkeypatch, capsys, cores, said):
    import autopart.tools.cli

    monkeypatch.setattr(autopart.tools.cli, "usable_cores", lambda: cores)
    cli_main(["compile", str(TINY_GPT), "--pp", "2", "--microbatches", "2", "--time-limit", "5",
              "-o", str(tmp_path / "out")])
    printed = " ".join(capsys.readouterr().out.split())
    line = "its 2 ranks take turns on this machine's 1 core (the predicted step counts it): here, fewer ranks may"
    assert (line in printed) is said
