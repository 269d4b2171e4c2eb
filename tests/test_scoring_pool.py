"""The search's layouts scored ahead in worker processes (`autopart.solve.scoring_pool`): the
same result as one process, layouts that need chain costs the workers lack go to new workers,
and what goes wrong in a worker reaches the caller."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopart.ir.errors import ConfigError
from autopart.solve import scoring_pool
from autopart.solve.scoring_pool import LayoutScoring, search_workers
from autopart.solve.search import SearchSpace, search
from tests.synthetic_chains import cluster, random_table

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the workers are forked (Linux)")


def _fingerprint(result):
    return ([(s.layout, s.cut, s.estimate_s, s.step_s) for s in result.ranked],
            result.layouts, result.scored, result.fitting, result.bound_s)


# Seeds whose searches catch what one process would do otherwise: a layout scored ahead that
# its turn's last finalist would not have refined (with 2 workers), and one scored ahead whose
# bound the last finalist has passed by its turn (with 8, sixteen layouts in flight)
@pytest.mark.parametrize("seed, workers, score_on_workers",
                         [(0, 2, False), (23, 2, True), (25, 2, False), (10, 8, True), (22, 8, False)])
def test_workers_find_what_one_process_finds(seed, workers, score_on_workers):
    """Every finalist, its cuts and figures, and the counts, on random chains and clusters whose
    searches refine some layouts and not others (the last finalist moves as results come in),
    with the finalists' own scoring on the workers too."""
    rng = random.Random(seed)
    table = random_table(rng, layers=rng.randint(6, 12))
    base = table.chain_costs(micro_batch_size=1, tp=1, dtype="fp32")
    whole = 4 * sum(base.parameter_bytes.values()) + 32 * sum(base.saved_bytes)
    devices = cluster(memory_bytes=int(whole * rng.uniform(0.05, 0.5)), gpus_per_node=4)
    space = SearchSpace(world_size=16, global_batch_size=32, gpus_per_node=4)

    def score(scored):  # the finalists' scoring: a figure of their own, so that it shows where it ran
        return scored.estimate_s * 1.01

    alone = search(space, table, devices, workers=0, score=score)
    forked = search(space, dataclasses.replace(table), devices, workers=workers, score=score,  # a copy: nothing cached
                    score_on_workers=score_on_workers)
    assert alone.ranked and _fingerprint(forked) == _fingerprint(alone)
    assert alone.scored > 8  # enough to run ahead of the walk


def test_layouts_are_scored_in_the_workers_in_turn_and_each_new_key_forks_new_workers():
    built: dict[str, int] = {}  # what the parent has made before sending a layout that reads it

    def score(layout, below):
        return os.getpid(), built[layout[0]] + layout[1], below

    with LayoutScoring(score, workers=2, key=lambda layout: layout[0]) as scoring:
        built["a"] = 100
        first = [scoring.submit(("a", k), 1.0) for k in range(6)]
        built["b"] = 200  # made after the first workers were forked: they do not have it
        second = [scoring.submit(("b", k), 0.5) for k in range(6)]
        answers = [handle.result() for handle in first + second]
        assert scoring.ahead == 4
    assert [value for _, value, _ in answers] == [100 + k for k in range(6)] + [200 + k for k in range(6)]
    assert [below for _, _, below in answers] == [1.0] * 6 + [0.5] * 6
    assert os.getpid() not in {pid for pid, _, _ in answers}
    assert {pid for pid, _, _ in answers[:6]}.isdisjoint(pid for pid, _, _ in answers[6:])


def test_without_workers_each_layout_is_scored_at_once_in_this_process():
    calls = []
    scoring = LayoutScoring(lambda layout, below: calls.append(layout) or os.getpid(), workers=0, key=lambda _: 0)
    handle = scoring.submit("x", 1.0)
    assert calls == ["x"] and handle.result() == os.getpid() and scoring.ahead == 1


def _wait_for(path: Path) -> bool:
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return path.exists()


def test_the_callers_work_runs_here_while_the_workers_finish_the_finalists(tmp_path):
    begun, made = tmp_path / "begun", tmp_path / "made"  # each side waits for what the other makes

    def finish(item):
        begun.touch()
        return os.getpid(), item, _wait_for(made)

    seen = []

    def meanwhile(finalists):
        seen.append((os.getpid(), list(finalists), _wait_for(begun)))
        made.touch()

    with LayoutScoring(lambda layout, below: layout, workers=2, key=lambda _: 0, finish=finish,
                       finish_on_workers=True) as scoring:
        scoring.submit("a", 1.0).result()  # the workers forked
        answers = scoring.finished(["a", "b", "c"], meanwhile)
    assert seen == [(os.getpid(), ["a", "b", "c"], True)]  # a worker had begun as it ran
    assert [(item, waited) for _, item, waited in answers] == [("a", True), ("b", True), ("c", True)]
    assert os.getpid() not in {pid for pid, _, _ in answers}


def test_a_failure_of_the_callers_work_reaches_it_and_cancels_the_finalists_not_begun(tmp_path):
    def finish(item):  # each finalist that runs leaves a file
        (tmp_path / item).touch()
        time.sleep(0.05)
        return item

    def meanwhile(finalists):
        raise KeyboardInterrupt

    with LayoutScoring(lambda layout, below: layout, workers=2, key=lambda _: 0, finish=finish,
                       finish_on_workers=True) as scoring:
        scoring.submit("a", 1.0).result()
        with pytest.raises(KeyboardInterrupt):
            scoring.finished([str(k) for k in range(50)], meanwhile)
    assert len(list(tmp_path.iterdir())) < 50  # the pool closed without running those not begun


def test_without_workers_the_callers_work_runs_before_the_finalists_are_finished():
    order = []
    scoring = LayoutScoring(lambda layout, below: layout, workers=0, key=lambda _: 0,
                            finish=lambda item: order.append(item) or item)
    assert scoring.finished(["a", "b"], lambda finalists: order.append(tuple(finalists))) == ["a", "b"]
    assert order == [("a", "b"), "a", "b"]


def test_an_error_in_a_worker_reaches_the_caller():
    def score(layout, below):
        raise ValueError(f"no cuts for {layout}")

    with LayoutScoring(score, workers=2, key=lambda _: 0) as scoring:
        handle = scoring.submit("pp4", 1.0)
        with pytest.raises(ValueError, match="no cuts for pp4"):
            handle.result()


def test_workers_by_default_and_by_the_environment(monkeypatch):
    monkeypatch.delenv(scoring_pool.WORKERS_ENV, raising=False)
    monkeypatch.setattr(scoring_pool, "usable_cores", lambda: 4)
    assert search_workers(scoring_pool.PARALLEL_FROM - 1) == 0  # a small search stays in this process
    assert search_workers(scoring_pool.PARALLEL_FROM) == 4
    monkeypatch.setattr(scoring_pool, "usable_cores", lambda: 64)
    assert search_workers(10_000) == scoring_pool.MOST_WORKERS
    monkeypatch.setattr(scoring_pool, "usable_cores", lambda: 1)
    assert search_workers(10_000) == 0
    monkeypatch.setenv(scoring_pool.WORKERS_ENV, "3")
    assert search_workers(10) == 3
    for text in ("two", "²"):  # (a digit to str.isdigit, not to int)
        monkeypatch.setenv(scoring_pool.WORKERS_ENV, text)
        with pytest.raises(ConfigError, match=f"AUTOPART_SEARCH_WORKERS='{text}' is not a number"):
            search_workers(10)


def test_a_bad_worker_count_is_a_one_line_error(tmp_path):
    env = {**os.environ, scoring_pool.WORKERS_ENV: "-1", "AUTOPART_NO_MEASURE": "1"}
    run = subprocess.run([sys.executable, "-m", "autopart", "compile", str(REPO / "examples" / "gpt.py"), "-o",
                          str(tmp_path / "out"), "--world-size", "2", "--global-batch-size", "4", "--device",
                          "h100-sxm"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2, run.stderr
    assert "AUTOPART_SEARCH_WORKERS='-1' is not a number of processes" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("model, twins_settle", [("gpt.py", False), ("gpt.py", True), ("llama.py", False)])
def test_the_compiler_s_search_on_workers_plans_what_it_plans_in_one_process(model, twins_settle, monkeypatch):
    """The planner's searches (finalists planned on the full model in this process, or simulated
    on a shallow copy's costs on the workers), whole. examples/gpt.py at world size 8 sends a
    ZeRO-2 layout while its ZeRO-1 twin is still being cut; with ``twins_settle`` every ZeRO-1
    result settles its twin (``fsdp_may_pay`` says ZeRO-2 cannot pay), so that layout's turn
    must skip it, as one process never sent it."""
    from autopart.driver import CompileOptions
    from autopart.solve import search as search_module
    from autopart.solve.planner import plan_by_search

    if twins_settle:
        monkeypatch.setattr(search_module, "fsdp_may_pay", lambda *args: False)

    options = CompileOptions(model=REPO / "examples" / model, world_size=8, global_batch_size=16, device="h100-sxm")
    searched = {}
    for workers in ("0", "2"):
        monkeypatch.setenv(scoring_pool.WORKERS_ENV, workers)
        plan = plan_by_search(options).plan
        search_record = {k: v for k, v in plan.provenance.search.items() if k != "seconds"}
        searched[workers] = (search_record, plan.predicted.step_s, [s.nodes for s in plan.stages])
    assert searched["2"] == searched["0"]


@pytest.mark.parametrize("settling", ["every twin", "some twins"])
def test_a_zero2_layout_waits_for_its_queued_zero1_twin_instead_of_being_scored_ahead(settling, monkeypatch):
    """One process never scores a ZeRO-2 layout that its ZeRO-1 twin settled first; the workers
    must not either: sent ahead while its twin was still queued, it was work thrown away at its
    turn (95 of 777 layouts of a 1,024-layer search). One the twin leaves unsettled is scored at
    its turn, with the answer one process gives. examples/gpt.py at world size 8 and batch 32 queues twins."""
    from autopart.driver import CompileOptions
    from autopart.solve import search as search_module
    from autopart.solve.planner import plan_by_search

    if settling == "every twin":
        monkeypatch.setattr(search_module, "fsdp_may_pay", lambda *args: False)
    else:  # a fixed half of them, whatever the hash seed
        monkeypatch.setattr(search_module, "fsdp_may_pay", lambda result, *args: result.layout.micro_batch_size % 2 == 0)
    submitted, queued = {}, []
    submit, sent = LayoutScoring.submit, search_module._sent

    def recording(self, layout, below):
        submitted.setdefault(self.workers, []).append(layout)
        return submit(self, layout, below)

    def queueing(layout, *args):
        handle = sent(layout, *args)
        queued.append((layout, handle is search_module._AT_TURN))
        return handle

    at_turn = []
    here = LayoutScoring.here

    def scored_here(self, layout, below):
        at_turn.append(self.workers)
        return here(self, layout, below)

    monkeypatch.setattr(LayoutScoring, "submit", recording)
    monkeypatch.setattr(LayoutScoring, "here", scored_here)
    monkeypatch.setattr(search_module, "_sent", queueing)
    options = CompileOptions(model=REPO / "examples" / "gpt.py", world_size=8, global_batch_size=32, device="h100-sxm")
    searched = {}
    for workers in ("0", "2"):
        monkeypatch.setenv(scoring_pool.WORKERS_ENV, workers)
        plan = plan_by_search(options).plan
        searched[workers] = ({k: v for k, v in plan.provenance.search.items() if k != "seconds"}, plan.predicted.step_s)
    forked = submitted.get(2, [])
    assert searched["2"] == searched["0"] and any(at_turn for _, at_turn in queued)
    ahead = [layout for k, layout in enumerate(forked)
             if layout.zero == 2 and dataclasses.replace(layout, zero=1) in forked[:k]]
    assert ahead == []
    assert (2 in at_turn) is (settling == "some twins")  # a queued twin left unsettled: scored at its turn
