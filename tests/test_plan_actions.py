"""The plan holds each rank's action list, and what runs is exactly that list.

The lists are written into plan.json and schedule.csv by the compile; `train.py` validates them
before any rank waits for a peer (a bad hand edit is one line naming the rank and the position,
exit code 2), and a valid hand edit changes the order the ranks run (read back from the measured
``--trace``) without changing the losses or the weights.
"""

import json
import re
import shutil
from pathlib import Path

import pytest

from autopart.tools import cli
from autopart.ir.errors import ScheduleError
from autopart.ir.plan import load_plan
from autopart.predict.timeline import plan_schedule, plan_timeline
from autopart.runtime import train
from autopart.schedule import (StageCosts, action_lists, add_communication, build_schedule, generated, plan_actions,
                               read_chrome_trace, read_schedule_csv, simulate)
from tests.distributed import REPO, Trained, assert_same_training, read_metrics, run_ranks, stage_weights
from tests.refusals import refused

PP, MICROBATCHES = 2, 4


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """1F1B over two ranks, four microbatches of one sample: small, and with room to reorder."""
    out = tmp_path_factory.mktemp("actions") / "out"
    cli.main(["compile", str(REPO / "examples" / "gpt.py"), "-o", str(out), "--pp", str(PP), "--microbatches",
              str(MICROBATCHES), "--global-batch-size", str(MICROBATCHES), "--schedule", "1f1b"])
    return out


def _edited(compiled: Path, folder: Path, edit) -> Path:
    """A copy of the output directory whose plan.json's action lists ``edit`` changed in place."""
    out = shutil.copytree(compiled, folder / "out")
    data = json.loads((out / "plan.json").read_text())
    edit(data["schedule"]["actions"])
    (out / "plan.json").write_text(json.dumps(data, indent=2))
    return out


def test_the_plan_and_schedule_csv_hold_the_same_lists(compiled):
    plan = load_plan(compiled / "plan.json")
    generated = build_schedule("1f1b", ranks=PP, microbatches=MICROBATCHES)
    assert plan.schedule.actions == action_lists(generated)
    assert read_schedule_csv(compiled / "schedule.csv") == generated
    assert plan_schedule(plan) == add_communication(generated, ranks=PP)


def test_an_unedited_plan_shares_its_kinds_schedule_validated_once(tmp_path, compiled):
    # a compile reads its plan's schedule several times; an unedited one is built and checked once
    plan = load_plan(compiled / "plan.json")
    assert plan_schedule(plan) is plan_schedule(load_plan(compiled / "plan.json"))
    assert plan_schedule(plan, lowered=False) is generated("1f1b", PP, MICROBATCHES, 1).compute
    gpipe = action_lists(build_schedule("gpipe", ranks=PP, microbatches=MICROBATCHES))
    edited = load_plan(_edited(compiled, tmp_path, lambda a: a.__setitem__(slice(None), [list(r) for r in gpipe]))
                       / "plan.json")
    assert plan_schedule(edited, lowered=False) == build_schedule("gpipe", ranks=PP, microbatches=MICROBATCHES)


def test_an_unedited_plan_is_simulated_once_and_an_edited_one_on_its_own_lists(tmp_path, compiled):
    # the plan's figures and its report read one simulation of its kind's schedule (a million
    # actions at scale); an edited plan's timeline is its own lists'
    plan = load_plan(compiled / "plan.json")
    assert plan_timeline(plan) is plan_timeline(load_plan(compiled / "plan.json"))
    gpipe = build_schedule("gpipe", ranks=PP, microbatches=MICROBATCHES)
    edited = load_plan(_edited(compiled, tmp_path, lambda a: a.__setitem__(slice(None), [list(r) for r in
                                                                                   action_lists(gpipe)]))
                       / "plan.json")
    costs = StageCosts(forward_s=tuple(s.forward_s for s in edited.stages),
                       backward_s=tuple(s.backward_s for s in edited.stages),
                       weight_s=tuple(s.backward_weight_s for s in edited.stages), transfer_s=edited.predicted.transfer_s)
    assert plan_timeline(edited).events == simulate(gpipe, costs, ranks=PP).events != plan_timeline(plan).events


def test_the_step_model_simulates_the_built_schedule_and_only_a_plan_s_lists_are_validated(monkeypatch):
    # validating a thousand microbatches over a hundred ranks takes seconds: the search's
    # candidates are simulated unvalidated (the simulator finds a deadlock itself), a plan's lists
    # are validated before anything runs them, and both share one built schedule
    from autopart.schedule import stored

    checked = []
    monkeypatch.setattr(stored, "_checked", lambda schedule, shape, **check: checked.append(shape))
    shape = ("zb-h1", 3, 7, 1)
    stored.generated.cache_clear()
    stored.built.cache_clear()
    stored.built_lowered.cache_clear()
    lowered = stored.built_lowered(*shape)
    assert checked == []
    assert stored.generated(*shape).lowered is lowered and len(checked) == 2  # its compute order, its messages
    assert lowered == add_communication(build_schedule("zb-h1", ranks=3, microbatches=7), ranks=3)


@pytest.fixture
def faulty(monkeypatch):
    """``faulty(compute=..., lowered=...)``: the schedule module, building its schedules with
    ``compute`` and ``lowered`` changing what the generator and the lowering return (as a bug in
    either would); its caches emptied before and after, so no test sees another's schedules."""
    from autopart.schedule import stored

    caches = (stored.generated, stored.built, stored.built_lowered)

    def building(*, compute=lambda s: s, lowered=lambda s: s):
        for cache in caches:
            cache.cache_clear()
        monkeypatch.setattr(stored, "build_schedule", lambda *a, **k: compute(build_schedule(*a, **k)))
        monkeypatch.setattr(stored, "add_communication", lambda *a, **k: lowered(add_communication(*a, **k)))
        return stored

    yield building
    for cache in caches:
        cache.cache_clear()


def _swapped(schedule, rank, first, second):
    changed = {r: list(actions) for r, actions in schedule.items()}
    i, j = (list(map(str, changed[rank])).index(name) for name in (first, second))
    changed[rank][i], changed[rank][j] = changed[rank][j], changed[rank][i]
    return changed


def test_a_generated_schedule_is_validated_in_its_compute_order_and_its_messages(faulty):
    # a generator's bug is caught where its schedule is first handed to a plan, as an edit would be
    with pytest.raises(ScheduleError, match=r"rank 1, position 0: 1B0 runs before 1F0"):
        faulty(compute=lambda s: _swapped(s, 1, "1F0", "1B0")).generated("1f1b", 2, 4, 1)
    # and the lowering's: two receives of rank 0 taken out of the order rank 1 sends them
    with pytest.raises(ScheduleError, match=r"rank 0, position 2: 0RECV_B1 receives out of order"):
        faulty(lowered=lambda s: _swapped(s, 0, "0RECV_B0", "0RECV_B1")).generated("1f1b", 2, 4, 1)


def _swap(actions, rank, a, b):
    i, j = actions[rank].index(a), actions[rank].index(b)
    actions[rank][i], actions[rank][j] = actions[rank][j], actions[rank][i]


BAD_EDITS = {  # name -> (the edit of the lists, the pattern of the one line)
    "on_the_wrong_rank": (lambda a: a[0].insert(0, a[1].pop(0)),
                          r"rank 0, position 0: 1F0 is on the wrong rank: stage 1 lives on rank 1"),
    "missing_backward": (lambda a: a[1].remove("1B3"), r"stage 1, microbatch 3 never runs its backward"),
    "backward_first": (lambda a: _swap(a, 1, "1F0", "1B0"), r"rank 1, position 0: 1B0 runs before 1F0"),
    "malformed": (lambda a: a[1].__setitem__(2, "1X1"), r"rank 1, position 2: malformed action '1X1'"),
    "a_message": (lambda a: a[0].insert(1, "0SEND_F0"), r"rank 0, position 1: 0SEND_F0 is a message"),
    "one_list": (lambda a: a.pop(), r"has 1 lists but the pipeline has 2 ranks"),
    # rank 1 sends microbatch 1's gradient first; rank 0 would take it as microbatch 0's
    "receives_out_of_order": (lambda a: _swap(a, 1, "1F0", "1F1") or _swap(a, 1, "1B0", "1B1"),
                              r"rank 0, position 2: 0RECV_B0 receives out of order: gradient message 0 from "
                              r"rank 1 is 1SEND_B1"),
}


@pytest.mark.parametrize("case", sorted(BAD_EDITS))
def test_a_bad_edit_is_one_line_before_any_peer(tmp_path, capsys, monkeypatch, compiled, case):
    edit, pattern = BAD_EDITS[case]
    out = _edited(compiled, tmp_path, edit)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(PP))
    line = refused(capsys, lambda: train.main(out, []), out)
    assert line.startswith("autopart: error: plan.schedule.actions"), line
    assert re.search(pattern, line), line


def test_a_rank_runs_the_lists_its_compile_validated_without_validating_them_again(tmp_path, monkeypatch, compiled):
    # every rank reads the whole schedule as it starts (a million actions at scale): lists equal to
    # their kind's generated order were validated by the compile that wrote them; edits are checked
    from autopart.schedule import stored

    checked = []
    monkeypatch.setattr(stored, "_checked", lambda schedule, shape, **check: checked.append(shape))
    for cache in (stored.generated, stored.built, stored.built_lowered):
        cache.cache_clear()
    monkeypatch.setattr(stored, "_validated", set())
    plan = load_plan(compiled / "plan.json")
    lowered = plan_actions(plan, compiled=True)
    assert checked == [] and lowered == add_communication(build_schedule("1f1b", ranks=PP, microbatches=MICROBATCHES),
                                                          ranks=PP)
    assert plan_actions(plan) == lowered and len(checked) == 2  # elsewhere (explain, a report) validated
    gpipe = [list(r) for r in action_lists(build_schedule("gpipe", ranks=PP, microbatches=MICROBATCHES))]
    edited = load_plan(_edited(compiled, tmp_path, lambda a: a.__setitem__(slice(None), gpipe)) / "plan.json")
    checked.clear()
    plan_actions(edited, compiled=True)
    assert len(checked) == 2


def test_a_plan_without_lists_runs_its_kind(compiled):
    # Plans written before the lists were stored ran their kind's order: they keep running it.
    data = json.loads((compiled / "plan.json").read_text())
    del data["schedule"]["actions"]
    from autopart.ir.plan import Plan

    old = Plan.from_json(data)
    assert old.schedule.actions == ()
    assert plan_schedule(old) == plan_schedule(load_plan(compiled / "plan.json"))


def test_compile_with_an_edited_plan_keeps_its_lists(tmp_path, capsys, compiled):
    gpipe = action_lists(build_schedule("gpipe", ranks=PP, microbatches=MICROBATCHES))
    edited = _edited(compiled, tmp_path, lambda a: a.__setitem__(slice(None), [list(r) for r in gpipe]))
    again = tmp_path / "again"
    cli.main(["compile", str(REPO / "examples" / "gpt.py"), "-o", str(again), "--plan", str(edited / "plan.json")])
    assert load_plan(again / "plan.json").schedule.actions == gpipe
    assert read_schedule_csv(again / "schedule.csv") == build_schedule("gpipe", ranks=PP, microbatches=MICROBATCHES)
    broken = _edited(compiled, tmp_path / "b", lambda a: a[1].remove("1B3"))
    line = refused(capsys, lambda: cli.main(["compile", str(REPO / "examples" / "gpt.py"), "-o",
                                             str(tmp_path / "c"), "--plan", str(broken / "plan.json")]))
    assert "plan.schedule.actions: stage 1, microbatch 3 never runs its backward" in line, line


@pytest.mark.multiprocess
def test_a_hand_edited_order_is_what_runs(tmp_path, compiled):
    # GPipe's order under the 1F1B plan: every forward first on both ranks.
    gpipe = build_schedule("gpipe", ranks=PP, microbatches=MICROBATCHES)
    out = _edited(compiled, tmp_path, lambda a: a.__setitem__(slice(None), [list(r) for r in action_lists(gpipe)]))
    assert action_lists(gpipe) != load_plan(compiled / "plan.json").schedule.actions
    trace, metrics = tmp_path / "measured.json", tmp_path / "metrics.jsonl"
    result = run_ranks(out, PP, "--steps", "2", "--lr", "0.1", "--optimizer", "sgd", "--metrics", str(metrics),
                       "--save-weights", str(tmp_path / "final"), "--trace", str(trace), timeout=180)
    assert result.returncode == 0, result.stderr
    measured = read_chrome_trace(trace)
    assert {r: [e.action for e in events] for r, events in measured.per_rank().items()} == gpipe
    run = Trained(plan=load_plan(out / "plan.json"), out=out, metrics=read_metrics(metrics),
                  finals=stage_weights(tmp_path / "final"), steps=2, trace=trace)
    assert_same_training(run, optimizer="sgd", lr=0.1)
