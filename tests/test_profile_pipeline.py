"""``--profile-pipeline``: the action times the programs record, the factor taken from them, its
place in the cost database and in the step model."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import autopart
import autopart.profiling.pipeline
from autopart.tools.cli import main as cli_main
from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.plan import load_plan
from autopart.profiling.pipeline import action_seconds, message_times, measure, pipeline_key, plan_pipeline_key
from autopart.schedule import Action, add_communication, build_schedule
from cost_models import CostDatabase
from cost_models.database import PipelineMeasurement, RuntimeOverheads, plan_shape
from cost_models.roofline import RooflineCostModel
from autopart.runtime.measure import StopRule
from tests.distributed import run_ranks

TINY_GPT = Path(__file__).parent / "models" / "tiny_gpt.py"
OVERHEADS = RuntimeOverheads(autograd_call_s=1e-4, module_call_s=2e-5)


@pytest.fixture(autouse=True)
def quiet_two_core_machine(monkeypatch):
    """The two figures the step model reads from the machine at compile time, injected: two cores
    and no busy process beside the compile. Two compiles of one test then predict alike wherever
    and beside whatever the suite runs; a test that studies the load sets its own figure."""
    from cost_models import calibration, devices

    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(calibration, "background_load", lambda cores, seconds=0.3: 0.0)


def tiny_options(tmp_path: Path, **changes) -> CompileOptions:
    return CompileOptions(model=TINY_GPT, pp=2, microbatches=4, micro_batch_size=2, costs=tmp_path / "costs.json",
                          time_limit_s=5, **changes)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The tiny GPT on two stages with its ops timed, and its database."""
    folder = tmp_path_factory.mktemp("profile_pipeline")
    plan, out = compile_to_directory(tiny_options(folder), folder / "out")
    return plan, out, folder


def actions_of(plan) -> dict[int, list[str]]:
    schedule = add_communication(
        build_schedule(plan.schedule.kind, ranks=plan.mesh["pp"], microbatches=plan.schedule.microbatches,
                       chunks=plan.schedule.chunks), ranks=plan.mesh["pp"])  # fmt: skip
    return {rank: [str(a) for a in actions] for rank, actions in schedule.items()}


@pytest.mark.multiprocess
def test_action_times_hold_every_action_of_every_rank_and_step(compiled, tmp_path):
    plan, out, _ = compiled
    run_ranks(out, 2, "--steps", "3", "--action-times", str(tmp_path / "times"))
    expected = actions_of(plan)
    for rank in (0, 1):
        lines = [json.loads(line) for line in (tmp_path / "times" / f"rank_{rank}.jsonl").read_text().splitlines()]
        assert [line["step"] for line in lines] == [0, 1, 2]
        for line in lines:
            assert [name for name, *_ in line["actions"]] == expected[rank]
            for name, start, end, cpu_s in line["actions"]:
                assert 0 <= start <= end and cpu_s >= 0
                if Action.parse(name).is_compute:  # a forward's CPU time is its own, within its wall time
                    assert 0 < cpu_s <= (end - start) * 1.05 + 1e-4, (name, start, end, cpu_s)
            tail_start, tail_end, tail_cpu, tied_end, optimizer_start = line["tail"]
            assert line["actions"][-1][2] <= tail_start <= tied_end <= optimizer_start < tail_end and tail_cpu > 0


def fake_times(folder: Path, plan, scale: float | tuple[float, ...], *, steps: int = 6, warmup: int = 4) -> Path:
    """Action files in which every compute action took ``scale`` (per stage, or one for all)
    times the plan's count plus the
    runtime's fixed cost, and the warm-up steps ten times more; rank 0 comes to the tied sums
    last, at 10 ms, and sums for 3 ms, while rank 1 waits there from 5 ms; then the optimizer
    steps for 4 ms on rank 0 and 6 ms on rank 1."""
    folder.mkdir()
    for rank, names in actions_of(plan).items():
        lines = []
        for step in range(steps):
            actions = []
            for name in names:
                action = Action.parse(name)
                compute, fixed = action_seconds(plan, action, OVERHEADS) if action.is_compute else (0.0, 0.0)
                factor = scale[action.stage] if isinstance(scale, tuple) else scale
                cpu = (factor * compute + fixed) * (10 if step < warmup else 1)
                actions.append([name, 0.0, cpu, cpu / 2])  # half its wall time on the CPU
            start = 0.010 if rank == 0 else 0.005
            tail = [start, 0.02, 1e-3, 0.013, 0.02 - (0.004 if rank == 0 else 0.006)]  # optimizer steps of 4 and 6 ms
            lines.append(json.dumps({"step": step, "origin": 0.0, "actions": actions, "tail": tail}))
        (folder / f"rank_{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_the_factor_is_the_stages_compute_over_the_plans_after_the_warm_up(compiled, tmp_path):
    plan, _, _ = compiled
    profile = measure(plan, fake_times(tmp_path / "a", plan, 1.37), OVERHEADS, cores=2)
    assert profile.measured.compute_factor == pytest.approx(1.37)
    assert [profile.measured.stage_factor(s.blocks) for s in plan.stages] == pytest.approx([1.37, 1.37])
    assert profile.steps == 2
    assert profile.measured.tied_s == pytest.approx(0.003)  # the last holder's: the others waited
    first, last = (stage.blocks for stage in plan.stages)
    assert profile.measured.optimizer_s == pytest.approx({f"{first[0]}-{first[1]}": 0.004,
                                                         f"{last[0]}-{last[1]}": 0.006})
    assert profile.key == pipeline_key(plan.provenance.model_sha256, plan.mesh, 2, "adamw", dtype=plan.dtype,
                                       zero=plan.zero, recompute=("none", "none"))
    assert profile.key == plan_pipeline_key(plan)
    assert profile.predicted_s == pytest.approx(plan.schedule.microbatches * sum(
        s.forward_s + s.backward_s for s in plan.stages))
    (tmp_path / "a" / "rank_1.jsonl").unlink()
    with pytest.raises(RuntimeError, match="holds the action times of 1 ranks, not 2"):
        measure(plan, tmp_path / "a", OVERHEADS, cores=2)


def test_with_more_ranks_than_cores_the_factor_counts_cpu_time(compiled, tmp_path):
    plan, _, _ = compiled
    profile = measure(plan, fake_times(tmp_path / "c", plan, 1.2), OVERHEADS, cores=1)
    fixed = sum(action_seconds(plan, Action.parse(n), OVERHEADS)[1]  # a step's, halved with the rest
                for names in actions_of(plan).values() for n in names if Action.parse(n).is_compute)
    assert profile.measured.compute_factor == pytest.approx(0.6 - fixed / 2 / profile.predicted_s)


def test_messages_are_paired_on_the_hosts_clock():
    ms = 1e-3
    messages = {
        (5, 0, 0, "0SEND_F0"): (1.0, 1.0 + 0.2 * ms),
        (5, 0, 0, "1RECV_F0"): (0.999, 1.0 + 0.8 * ms),  # waited: delivered 0.6 ms after the send
        (5, 0, 0, "0SEND_F1"): (1.002, 1.002 + 0.2 * ms),
        (5, 0, 0, "1RECV_F1"): (1.010, 1.010 + 0.3 * ms),  # its data was there
        (5, 0, 0, "1SEND_B0"): (1.02, 1.02 + 0.2 * ms),
        (6, 0, 0, "0RECV_B0"): (1.021, 1.03),  # another step's send: no pair
    }
    assert message_times(messages) == pytest.approx((0.2 * ms, 0.3 * ms, 0.3 * ms, 0.6 * ms))
    assert message_times({k: v for k, v in messages.items() if k[3] != "1RECV_F1"}) == (None,) * 4
    # gloo completes a receive that waited as its send ends, sooner than one whose data came first
    quick = {**messages, (5, 0, 0, "1RECV_F0"): (0.999, 1.0 + 0.25 * ms)}
    assert message_times(quick) == pytest.approx((0.2 * ms, 0.3 * ms, 0.0, 0.05 * ms))
    # a sender descheduled after its data left ends after the receive: that delivery took no time, not less
    early = {**messages, (5, 0, 0, "1RECV_F0"): (0.999, 1.0 + 0.1 * ms)}
    assert message_times(early) == pytest.approx((0.2 * ms, 0.3 * ms, 0.0, 0.0))


def test_each_stage_has_its_own_factor_and_the_others_the_pipelines(compiled, tmp_path):
    plan, _, _ = compiled
    measured = measure(plan, fake_times(tmp_path / "s", plan, (1.0, 1.5)), OVERHEADS, cores=2).measured
    first, last = (stage.blocks for stage in plan.stages)
    assert measured.stage_factors == pytest.approx({f"{first[0]}-{first[1]}": 1.0, f"{last[0]}-{last[1]}": 1.5})
    compute = [s.forward_s + s.backward_s for s in plan.stages]
    share = compute[1] / sum(compute)
    assert measured.compute_factor == pytest.approx(1.0 + 0.5 * share)  # all stages' compute together
    assert measured.stage_factor((first[0], first[1] + 1)) == measured.compute_factor  # cut elsewhere


def test_a_zero_bubble_plan_counts_its_split_backward(compiled, tmp_path):
    plan, _, _ = compiled
    split = replace(plan, schedule=replace(plan.schedule, kind="zb-h1"))
    assert any(name.endswith(("I0", "W0")) for name in actions_of(split)[0])
    assert measure(split, fake_times(tmp_path / "zb", split, 0.8), OVERHEADS, cores=2).measured.compute_factor == \
        pytest.approx(0.8)


def test_the_steps_variation_is_each_action_delivery_and_tail_against_its_median(compiled, tmp_path, monkeypatch):
    plan, _, _ = compiled
    folder = fake_times(tmp_path / "v", plan, 1.0, steps=7)  # steps 4, 5, 6 measured, alike
    ms = 1e-3
    for rank, change in ((1, lambda step, a: a[:2] + [a[2] * 3, a[3]] if step == 5 and a[0] == "1F2" else a),
                         (0, lambda step, a: [a[0], a[1], (5 if step == 6 else 3) * ms, a[3]] if a[0] == "0RECV_B1" else a)):
        file = folder / f"rank_{rank}.jsonl"
        records = [json.loads(line) for line in file.read_text().splitlines()]
        for record in records:
            record["actions"] = [change(record["step"], a) for a in record["actions"]]
            if rank == 1 and record["step"] == 6:
                record["tail"][1] += 8 * ms  # its optimizer step: 6 ms, 14 ms in step 6
        file.write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = measure(plan, folder, OVERHEADS, cores=2).measured.step_variation
    assert len(steps) == 3
    compute = {n for names in actions_of(plan).values() for n in names if Action.parse(n).is_compute}
    for number, step in zip((4, 5, 6), steps):
        assert {n for n in step if "RECV" not in n and "tail" not in n} >= compute
        for name, value in step.items():
            if "RECV" in name:  # the seconds beyond its median delivery (0RECV_B1 3 ms, 5 ms in step 6; the rest 0)
                assert value == pytest.approx(2 * ms if (number, name) == (6, "0RECV_B1") else 0.0), (number, name)
            elif name == "tail 1":  # tied sums 3 ms, optimizer 6 ms, and 14 ms in step 6
                assert value == pytest.approx(17 / 9 if number == 6 else 1.0)
            else:
                assert value == pytest.approx(3.0 if (number, name) == (5, "1F2") else 1.0), (number, name)
    # more steps than it keeps: evenly spaced, the first and the last
    monkeypatch.setattr(autopart.profiling.pipeline, "VARIATION_STEPS", 2)
    kept = measure(plan, folder, OVERHEADS, cores=2).measured.step_variation
    assert kept == (steps[0], steps[2])
    # ranks that outnumber the cores: the step model shares the cores itself, no replay
    assert measure(plan, folder, OVERHEADS, cores=1).measured.step_variation == ()


def test_the_measured_step_is_the_slowest_ranks_and_the_median_one_of_the_plan_run(compiled, tmp_path):
    plan, _, _ = compiled
    folder = fake_times(tmp_path / "s", plan, 1.0, steps=7)  # steps 4, 5, 6 measured, every rank ending at 20 ms
    for rank, step, end in ((0, 4, 0.025), (1, 5, 0.03)):
        file = folder / f"rank_{rank}.jsonl"
        records = [json.loads(line) for line in file.read_text().splitlines()]
        records[step]["tail"][1] = end
        file.write_text("".join(json.dumps(r) + "\n" for r in records))
    measured = measure(plan, folder, OVERHEADS, cores=2).measured
    assert measured.step_s == pytest.approx(0.025)  # the steps took 25, 30 and 20 ms
    assert measured.step_of == plan_shape(plan.schedule.kind, plan.schedule.microbatches, [s.blocks for s in plan.stages])
    assert measured.step_of == f"1f1b x4: {plan.stages[0].blocks[0]}-{plan.stages[0].blocks[1]}," \
                               f"{plan.stages[1].blocks[0]}-{plan.stages[1].blocks[1]}"


def test_the_plan_holds_the_step_its_own_profile_run_took(compiled, tmp_path, capsys):
    plan, _, folder = compiled
    options = tiny_options(folder)
    shape = plan_shape(plan.schedule.kind, plan.schedule.microbatches, [s.blocks for s in plan.stages])
    with_factor(folder, plan, 1.0, step_s=0.042, step_of=shape)
    same, out = compile_to_directory(options, tmp_path / "same")
    assert same.predicted.profiled_step_s == 0.042
    assert load_plan(out / "plan.json").predicted.profiled_step_s == 0.042
    cli_main(["compile", str(TINY_GPT), "--pp", "2", "--microbatches", "4", "--global-batch-size", "8",
              "--costs", str(folder / "costs.json"), "--time-limit", "5", "-o", str(tmp_path / "cli")])
    printed = " ".join(capsys.readouterr().out.split())  # as the console wraps it
    error = (same.predicted.step_s - 0.042) / 0.042
    assert f"this plan ran here at 42.000 ms a step (the median step of the run that measured its pipeline; predicted {error:+.1%})" \
        in printed
    # a plan of other cuts, or another schedule, was not the one that ran
    other = plan_shape(plan.schedule.kind, plan.schedule.microbatches, [(0, 0), (1, plan.stages[1].blocks[1])])
    for step_of in (other, shape.replace("1f1b", "gpipe"), ""):
        with_factor(folder, plan, 1.0, step_s=0.042, step_of=step_of)
        assert compile_to_directory(options, tmp_path / "other")[0].predicted.profiled_step_s is None
    # nor one that recomputes, or captured otherwise, of the same shape: its backwards ran no
    # forward again, its stages are other programs (its own pipeline is to run: the default
    # compile runs it, `profiled_in_place`)
    for changed in (dict(recompute="full"), dict(capture="export")):
        options = tiny_options(folder, **changed)
        cuts = [s.blocks for s in compile_to_directory(options, tmp_path / "changed")[0].stages]
        with_factor(folder, plan, 1.0, step_s=0.042,
                    step_of=plan_shape(plan.schedule.kind, plan.schedule.microbatches, cuts))
        other = compile_to_directory(options, tmp_path / "changed")[0]
        assert [s.blocks for s in other.stages] == cuts  # the same costs, the same cuts
        assert other.predicted.profiled_step_s is None, changed
        assert other.predicted.compute_factor_from != "pipeline", changed
    with_factor(folder, plan, None)


def test_the_steps_variation_survives_the_database(tmp_path):
    database = CostDatabase.load(tmp_path / "costs.json")
    measured = PipelineMeasurement(compute_factor=1.2, step_variation=({"0F0": 1.5, "1RECV_F0": -1e-5, "tail 0": 0.9},
                                                                       {"0F0": 1.0}),
                                   step_s=0.031, step_of="1f1b x4: 0-3,4-7", waited_s=2e-4, background_load=3.0)
    database.put_pipeline("cpu", "pipeline(x)", measured)
    database.save()
    assert CostDatabase.load(tmp_path / "costs.json").pipeline("cpu", "pipeline(x)") == measured


def with_factor(folder: Path, plan, factor: float | None, tied_s: float | None = None,
                optimizer_s: dict[str, float] | None = None, messages: tuple[float | None, ...] = (None,) * 4,
                step_variation: tuple[dict[str, float], ...] = (), step_s: float | None = None, step_of: str = "",
                background_load: float = 0.0, **stage_factors) -> None:
    database = CostDatabase.load(folder / "costs.json")
    key = plan_pipeline_key(plan)
    database.pipelines = {k: v for k, v in database.pipelines.items() if not k.endswith(key)}
    if factor is not None:
        database.put_pipeline("cpu", key, PipelineMeasurement(compute_factor=factor, tied_s=tied_s,
                                                               stage_factors=stage_factors,
                                                               optimizer_s=optimizer_s or {},
                                                               step_variation=step_variation,
                                                               step_s=step_s, step_of=step_of,
                                                               background_load=background_load,
                                                               **dict(zip(("send_s", "recv_s", "transfer_s", "waited_s"),
                                                                          messages))))
    database.save()


def test_a_stored_factor_scales_the_compute_and_replaces_waking_and_resuming(compiled, tmp_path, monkeypatch):
    plan, _, folder = compiled
    options = tiny_options(folder)
    with_factor(folder, plan, 1.0)
    at_one = compile_to_directory(options, tmp_path / "one")[0]
    assert (at_one.predicted.compute_factor, at_one.predicted.compute_factor_from) == ((1.0, 1.0), "pipeline")
    with_factor(folder, plan, 2.0)
    at_two = compile_to_directory(options, tmp_path / "two")[0]
    assert at_two.predicted.compute_factor == (2.0, 2.0)
    # every forward and backward of the pipeline doubles: the step grows by at least the
    # busiest rank's doubled compute
    busiest = max(plan.schedule.microbatches * (s.forward_s + s.backward_s) for s in plan.stages)
    assert at_two.predicted.step_s >= at_one.predicted.step_s + busiest * 0.99
    # measured in place, waking is in the factor: a wake cost the device claims changes nothing
    monkeypatch.setattr(RooflineCostModel, "wake_time", lambda self, idle_s: 0.05)
    assert compile_to_directory(options, tmp_path / "woken")[0].predicted.step_s == at_two.predicted.step_s
    first, last = (stage.blocks for stage in plan.stages)
    with_factor(folder, plan, 2.0, **{f"{last[0]}-{last[1]}": 3.0})
    per_stage = compile_to_directory(options, tmp_path / "per_stage")[0]
    assert per_stage.predicted.compute_factor == (2.0, 3.0)
    last_compute = plan.schedule.microbatches * (plan.stages[1].forward_s + plan.stages[1].backward_s)
    assert per_stage.predicted.step_s >= at_two.predicted.step_s + 0.99 * last_compute  # its third more
    with_factor(folder, plan, 2.0, tied_s=0.05)  # both ranks hold a copy of the tied embedding
    tied = compile_to_directory(options, tmp_path / "tied")[0]
    for before, after in zip(at_two.predicted.rank_tail_s, tied.predicted.rank_tail_s):
        assert 0.048 < after - before < 0.05  # 50 ms in place of the modelled all-reduce (under 2 ms)
    assert tied.predicted.step_s > at_two.predicted.step_s + 0.045
    with_factor(folder, plan, 2.0, tied_s=0.05, optimizer_s={f"{first[0]}-{first[1]}": 0.03})
    stepped = compile_to_directory(options, tmp_path / "stepped")[0]
    assert stepped.predicted.rank_tail_s[0] == pytest.approx(0.08)  # both measured
    assert stepped.predicted.rank_tail_s[1] == tied.predicted.rank_tail_s[1]  # its optimizer step modelled
    # messages as measured: 1F0's input comes 10 ms after 0F0, and 0B0's gradient 10 ms after 1B0
    with_factor(folder, plan, 2.0, messages=(0.0, 0.0, 0.01))
    slow_messages = compile_to_directory(options, tmp_path / "slow_messages")[0]
    assert slow_messages.predicted.step_s > at_two.predicted.step_s + 0.019
    # a receive takes 5 ms when its data came first and 1 ms when it waited for it: 1F0's input
    # is waited for (and 0B3's gradient, the last): 2 x 4 ms less than at 5 ms each
    with_factor(folder, plan, 2.0, messages=(0.0, 0.005, 0.0))
    slow_receives = compile_to_directory(options, tmp_path / "slow_receives")[0].predicted.step_s
    with_factor(folder, plan, 2.0, messages=(0.0, 0.005, 0.0, 0.001))
    waited = compile_to_directory(options, tmp_path / "waited")[0].predicted.step_s
    assert waited <= slow_receives - 0.008 + 1e-9
    with_factor(folder, plan, None)
    unprofiled = compile_to_directory(options, tmp_path / "unprofiled")[0]
    assert unprofiled.predicted.compute_factor_from != "pipeline"
    assert unprofiled.predicted.step_s > at_two.predicted.step_s  # 50 ms of waking now counts


def test_a_pipeline_measured_beside_busy_processes_is_not_slowed_by_them_again(compiled, tmp_path, monkeypatch):
    """The replayed actions of a pipeline run beside busy processes took their share of the cores
    already; the step model shared the cores out among them again: the quickstart, run beside 13
    busy processes at 24.8 ms a step, was predicted at 195.9 ms in the line above it (+691%)."""
    from cost_models import calibration

    plan, _, folder = compiled
    options = tiny_options(folder)
    with_factor(folder, plan, 1.0)
    quiet = compile_to_directory(options, tmp_path / "quiet")[0].predicted
    monkeypatch.setattr(calibration, "background_load", lambda cores, seconds=0.3: 6.0)
    busier = compile_to_directory(options, tmp_path / "busier")[0].predicted  # measured quiet, busy now
    assert busier.background_load == 6.0 and busier.step_s > 1.5 * quiet.step_s
    with_factor(folder, plan, 1.0, background_load=6.0)  # measured beside them
    beside = compile_to_directory(options, tmp_path / "beside")[0].predicted
    assert beside.background_load == 0.0 and beside.step_s == pytest.approx(quiet.step_s)
    with_factor(folder, plan, 1.0, background_load=4.0)  # beside fewer than now: the rest count
    assert compile_to_directory(options, tmp_path / "fewer")[0].predicted.background_load == 2.0


def test_the_step_model_replays_each_measured_step_and_takes_the_median(compiled, tmp_path):
    plan, _, folder = compiled
    options = tiny_options(folder)

    def step_s(*steps: dict[str, float]) -> float:
        with_factor(folder, plan, 1.0, step_variation=steps)
        return compile_to_directory(options, tmp_path / f"v{len(list(tmp_path.iterdir()))}")[0].predicted.step_s

    at_median = step_s()
    # all as the median: each action 1.0 times its time, each delivery 0 s late
    as_median = {n: 0.0 if "RECV" in n else 1.0 for names in actions_of(plan).values() for n in names}
    assert step_s(*[as_median] * 3) == pytest.approx(at_median, rel=1e-12)
    slow = {"1F0": 10.0}
    assert step_s(slow, {}, {}) == pytest.approx(at_median, rel=1e-12)  # one step in three: not the median's
    first_forward = plan.stages[1].forward_s
    assert step_s(slow, slow, {}) > at_median + 8 * first_forward  # two in three: the median step has it
    late = {"1RECV_F0": 0.01}  # its activation came 10 ms late: all of the pipeline waits
    assert step_s(late, late, {}) > at_median + 0.0099
    tail = compile_to_directory(options, tmp_path / "tail")[0].predicted.rank_tail_s[0]
    assert step_s(*[{"tail 0": 3.0}] * 3) == pytest.approx(at_median + 2 * tail)  # rank 0 ends the step


@pytest.mark.multiprocess
def test_profile_pipeline_runs_the_plan_once_and_compiles_with_what_it_measured(compiled, tmp_path, monkeypatch):
    plan, _, folder = compiled
    with_factor(folder, plan, None)
    options = tiny_options(folder, profile_pipeline=True)
    profiled = compile_to_directory(options, tmp_path / "profiled")[0]
    database = CostDatabase.load(folder / "costs.json")
    key = plan_pipeline_key(plan)
    stored = database.pipeline("cpu", key)
    # the pipeline's compute over its ops timed alone, each measured beside whatever else ran here
    # then: bounds a unit's error apart (1000x), not the few times that the load moves either by
    assert stored is not None and 0.05 < stored.compute_factor < 50
    assert 0 < stored.tied_s < 1  # the tiny GPT ties its embedding and head, on ranks 0 and 1
    assert (profiled.predicted.compute_factor, profiled.predicted.compute_factor_from) == \
        (tuple(stored.stage_factor(s.blocks) for s in profiled.stages), "pipeline")
    assert 0 < stored.step_s < 5
    ran_this_plan = stored.step_of == plan_shape(profiled.schedule.kind, profiled.schedule.microbatches,
                                                 [s.blocks for s in profiled.stages])
    assert profiled.predicted.profiled_step_s == (stored.step_s if ran_this_plan else None)
    # a second compile finds it and runs nothing
    monkeypatch.setattr(autopart.profiling.pipeline, "profile_pipeline", lambda *a, **k: pytest.fail("profiled again"))
    again = compile_to_directory(options, tmp_path / "again")[0]
    assert again.predicted.step_s == profiled.predicted.step_s


def test_busy_processes_beside_the_compile_slow_its_step_and_are_said(compiled, tmp_path, monkeypatch, capsys):
    """Both figures the step model takes from the machine are injected (quiet_two_core_machine,
    then two busy processes), so the test does not depend on where it runs or beside what."""
    from cost_models import calibration

    plan, _, folder = compiled
    with_factor(folder, plan, None)
    options = tiny_options(folder)
    monkeypatch.setattr(calibration, "background_load", lambda cores, seconds=0.3: 0.0)
    quiet = compile_to_directory(options, tmp_path / "quiet")[0]
    monkeypatch.setattr(calibration, "background_load", lambda cores, seconds=0.3: 2.0)
    busy, out = compile_to_directory(options, tmp_path / "busy")
    assert (quiet.predicted.background_load, busy.predicted.background_load) == (0.0, 2.0)
    # two ranks and two others on two cores: each rank computes at half speed or less
    busiest = max(plan.schedule.microbatches * (s.forward_s + s.backward_s) for s in busy.stages)
    assert busy.predicted.step_s > quiet.predicted.step_s + 0.9 * busiest
    assert load_plan(out / "plan.json").predicted.background_load == 2.0
    cli_main(["compile", str(TINY_GPT), "--pp", "2", "--microbatches", "4", "--global-batch-size", "8",
              "--costs", str(folder / "costs.json"), "--time-limit", "5", "-o", str(tmp_path / "cli")])
    printed = " ".join(capsys.readouterr().out.split())
    assert "2 other busy processes shared this machine's cores while it compiled; the predicted step counts them" \
        in printed


def test_where_the_ranks_share_the_cores_a_receive_that_waited_takes_its_own_time(compiled, tmp_path, monkeypatch):
    from cost_models import calibration

    plan, _, folder = compiled
    options = tiny_options(folder)
    monkeypatch.setattr(calibration, "background_load", lambda cores, seconds=0.3: 1.0)  # 2 ranks + 1 on 2 cores

    def step_s(*messages: float) -> float:
        with_factor(folder, plan, 2.0, messages=messages)
        return compile_to_directory(options, tmp_path / f"m{len(messages)}")[0].predicted.step_s

    # the woken rank gets its core back first: the receive's own time stands (see predicted_step_s)
    assert step_s(0.0, 0.005, 0.0, 0.001) == step_s(0.0, 0.005, 0.0)
    with_factor(folder, plan, None)


@pytest.mark.multiprocess
def test_a_run_for_seconds_stops_every_rank_after_the_same_step_within_its_least_and_most(compiled, tmp_path):
    """``--seconds``: the first step at which the agreed times (each the slowest rank's, rank 0's
    ``step_s``) of the steps past ``--untimed-steps`` sum to the bound ends the run on every rank,
    not before ``--min-steps``, never past ``--steps``; the run's last step is checkpointed as the end of a run of --steps is."""
    _, out, _ = compiled
    run_ranks(out, 2, "--steps", "400", "--min-steps", "3", "--untimed-steps", "2", "--seconds", "0.15",
              "--action-times", str(tmp_path / "a"), "--metrics", str(tmp_path / "m.jsonl"))
    step_s = [json.loads(line)["step_s"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    counts = {len((tmp_path / "a" / f"rank_{rank}.jsonl").read_text().splitlines()) for rank in (0, 1)}
    assert counts == {len(step_s)} and 3 <= len(step_s) < 400
    timed = step_s[2:]  # past the two untimed steps
    assert sum(timed[:-1]) < 0.15 <= sum(timed) or len(step_s) == 3
    run_ranks(out, 2, "--steps", "400", "--min-steps", "3", "--seconds", "0", "--action-times", str(tmp_path / "b"),
              "--checkpoint-dir", str(tmp_path / "c"))
    assert len((tmp_path / "b" / "rank_1.jsonl").read_text().splitlines()) == 3
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["step_00000003"]
    run_ranks(out, 2, "--steps", "2", "--seconds", "1000", "--action-times", str(tmp_path / "d"))
    assert len((tmp_path / "d" / "rank_0.jsonl").read_text().splitlines()) == 2


def test_the_stop_rule_counts_the_agreed_seconds_from_the_run_s_first_step():
    """A resumed run (first step 5) counts its own steps against ``--min-steps``, ``--untimed-steps``
    and ``--seconds``, and ``--steps`` is the step number it ends at, as without --seconds."""
    def stops(rule, times):
        return [rule.after(torch.tensor([t])) for t in times]

    assert stops(StopRule(5, 10, None), [9.0] * 5) == [False] * 4 + [True]
    assert stops(StopRule(5, 10, 1.0, min_steps=2), [0.6, 0.6, 0.1]) == [False, True, True]
    assert stops(StopRule(5, 100, 1.0, min_steps=3), [2.0, 0.1, 0.1]) == [False, False, True]
    assert stops(StopRule(5, 7, 100.0), [0.1, 0.1]) == [False, True]
    # the warm-up's slow steps do not count: 9 s, then 0.6 + 0.6 past it
    assert stops(StopRule(5, 100, 1.0, untimed=1), [9.0, 0.6, 0.6]) == [False, False, True]


def test_an_edit_to_a_file_beside_the_model_keys_its_measurements_afresh(tmp_path) -> None:
    """A model whose layers come from layers.py beside it, widened there 16 to 2048, was compiled
    with the pipeline factor and steps measured of the narrow one ('measured in this pipeline'):
    the keys of what was measured knew the model file alone. A plan written before the plan kept
    the files' hash keys its measurements by the model file's, as it did."""
    from autopart.profiling.finalist_cache import finalist_key
    from tests.tiny_models import beside_model

    model = beside_model(tmp_path)
    before = autopart.compile(model, pp=2, microbatches=2, device="a100-80gb")
    assert before.provenance.sources_sha256 not in ("", before.provenance.model_sha256)
    (tmp_path / "layers.py").write_text((tmp_path / "layers.py").read_text().replace("return torch", "return (torch"
                                                                                     ).replace("(8, 8)", "(8, 8))"))
    after = autopart.compile(model, pp=2, microbatches=2, device="a100-80gb")
    assert after.provenance.model_sha256 == before.provenance.model_sha256  # the model file is as it was
    assert plan_pipeline_key(after) != plan_pipeline_key(before)
    assert finalist_key(after, "cpu") != finalist_key(before, "cpu")
    older = replace(before, provenance=replace(before.provenance, sources_sha256=""))
    assert plan_pipeline_key(older).startswith(f"pipeline(model={before.provenance.model_sha256[:16]}, ")
