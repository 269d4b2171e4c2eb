"""A search on the machine at hand runs its finalists here and keeps the fastest
(`autopart.profiling.finalists`): when it does, how it judges the runs, and a real search."""

import json
from pathlib import Path

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.errors import ConfigError
from autopart.profiling import finalists as finalists_module
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


def test_progress_hears_every_run():
    run, _ = runs_of({0: [0.02, 0.02], 1: [0.021, 0.021], 2: [0.09]})
    heard = []
    chosen_by_running(3, run, lambda done, total: heard.append((done, total)))
    assert heard == [(1, 3), (2, 3), (3, 3), (4, 5), (5, 5)]


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
    monkeypatch.setattr(finalists_module, "usable_cores", lambda: 1)
    assert not finalists_run_here(options(world_size=8, global_batch_size=8))
    assert finalists_run_here(options(world_size=4))


@pytest.mark.parametrize("changes, named", [
    (dict(device="a100-80gb"), "--device a100-80gb is not this machine's"),
    (dict(world_size=4, gpus_per_node=2), "spans more than one node of 2"),
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


@pytest.mark.multiprocess
def test_a_search_runs_its_finalists_and_emits_the_fastest(tmp_path):
    """A real search at world size 2 (pinned to data parallelism over ZeRO levels, so it has a few
    finalists): each ran here, the plan kept is the one that ran fastest, and its directory is
    that plan's."""
    plan, out = compile_to_directory(
        options(run_finalists=True, pp=1, tp=1, schedule="1f1b", recompute="none", microbatches=2,
                dtype="fp32", time_limit_s=5),
        tmp_path / "out",
    )  # fmt: skip
    search = plan.provenance.search
    ranked = search["ranked"]
    assert search["chosen_by"] == "run" and search["run_seconds"] > 0
    assert len(ranked) >= 2
    steps = [row["measured_step_s"] for row in ranked]
    assert all(step > 0 for step in steps)
    assert all(row["launches"] in (1, 2) for row in ranked)
    assert steps[0] == min(steps) == plan.predicted.profiled_step_s
    written = json.loads((out / "plan.json").read_text())
    assert written["predicted"]["profiled_step_s"] == plan.predicted.profiled_step_s
    assert written["zero"] == plan.zero and written["mesh"] == plan.mesh
    zero = {0: "", 1: " zero", 2: " zero2", 3: " zero3"}[plan.zero]
    assert ranked[0]["layout"] == f"pp1 tp1 dp2 2x2 1f1b{zero}"


@pytest.mark.parametrize("cores, said", [(1, True), (2, False)])
def test_a_plan_of_more_ranks_than_cores_says_they_take_turns(tmp_path, monkeypatch, capsys, cores, said):
    import autopart.tools.cli

    monkeypatch.setattr(autopart.tools.cli, "usable_cores", lambda: cores)
    cli_main(["compile", str(TINY_GPT), "--pp", "2", "--microbatches", "2", "--time-limit", "5",
              "-o", str(tmp_path / "out")])
    printed = " ".join(capsys.readouterr().out.split())
    line = "its 2 ranks take turns on this machine's 1 core (the predicted step counts it): here, fewer ranks may"
    assert (line in printed) is said
