"""The plan's recompute modes and dtype as options and as fields: how a plan written with them
reads back, which values are refused and how, and that no plan is written whose recompute
outgrows the memory it was given."""

import json
import re
from dataclasses import replace

import pytest
import torch

import autopart
from autopart.driver import CompileOptions, compile_plan, compile_to_directory
from autopart.ir.errors import ConfigError, PlanError
from autopart.ir.plan import Plan, load_plan
from autopart.tools import cli
from tests.distributed import REPO

GPT = REPO / "examples" / "gpt.py"


@pytest.fixture(scope="module")
def bf16_gpt(tmp_path_factory):
    """The gpt example at pp=2 in bf16 (without recompute): its plan and output directory."""
    options = CompileOptions(model=GPT, pp=2, microbatches=4, micro_batch_size=2, dtype="bf16")
    return compile_to_directory(options, tmp_path_factory.mktemp("gpt-bf16") / "out")


def test_plan_round_trip_and_old_plans(bf16_gpt):
    plan, _ = bf16_gpt
    assert plan.dtype == "bf16" and all(s.recompute == "none" for s in plan.stages)
    data = plan.to_json()
    data["stages"][0]["recompute"] = "full"
    edited = Plan.from_json(data)
    assert edited.stages[0].recompute == "full" and Plan.from_json(edited.to_json()) == edited
    del data["dtype"]
    for stage in data["stages"]:
        del stage["recompute"]
    old = Plan.from_json(data)  # written before the fields existed
    assert old.dtype == "fp32" and all(s.recompute == "none" for s in old.stages)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(dtype="fp16"), r"plan\.dtype must be one of fp32, bf16, bf16-autocast, got \"fp16\""),
        (lambda d: d["stages"][1].update(recompute="some"), r"plan\.stages\[1\]\.recompute must be one of none, selective, full"),
        (lambda d: d["stages"][0].update(recompute=None), r"plan\.stages\[0\]\.recompute must be one of"),
    ],
)
def test_bad_plan_values_name_the_field(bf16_gpt, edit, message):
    plan, _ = bf16_gpt
    data = plan.to_json()
    edit(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_json(data)


def test_a_pinned_plan_keeps_its_recompute_and_dtype(bf16_gpt, tmp_path):
    plan, out = bf16_gpt
    data = json.loads((out / "plan.json").read_text())
    data["stages"][1]["recompute"] = "selective"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    pinned, emitted = compile_to_directory(CompileOptions(model=GPT, plan=tmp_path / "plan.json"), tmp_path / "out")
    assert pinned.dtype == "bf16" and [s.recompute for s in pinned.stages] == ["none", "selective"]
    assert load_plan(emitted / "plan.json") == pinned
    assert "torch.autocast(bfloat16)" in (emitted / "stages" / "stage_1.py").read_text()
    assert "selective recompute" in (emitted / "stages" / "stage_1.py").read_text()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(recompute="partial"), r"unknown --recompute mode 'partial'; use one of none, selective, full"),
        (dict(recompute=("full",)), r"--recompute lists 1 modes for 2 stages; .* --recompute full,full"),
        (dict(recompute=("full", "half")), r"unknown --recompute mode 'half'"),
        (dict(dtype="fp16"), r"unknown --dtype 'fp16'; use one of fp32, bf16, bf16-autocast"),
    ],
)
def test_bad_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        CompileOptions(model=GPT, pp=2, **options)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--recompute", "sometimes"], r"unknown --recompute mode 'sometimes'; use one of none, selective, full"),
        (["--recompute", "full,none,full"], r"--recompute lists 3 modes for 2 stages"),
        (["--dtype", "float16"], r"unknown --dtype 'float16'; use one of fp32, bf16, bf16-autocast"),
    ],
    ids=["mode", "count", "dtype"],
)
def test_bad_cli_values_are_one_line_exit_2(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compile", str(GPT), "-o", str(tmp_path / "out"), "--pp", "2", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopart: error: "), err
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "out").exists()


def test_a_stage_sends_only_what_the_plan_says():
    """The next stage sizes its receive buffers by the plan: other dtypes must stop F, not garble the message."""
    from autopart.ir.tensors import TensorMeta
    from autopart.runtime.executor import check_outputs

    promised = [TensorMeta(shape=(2, 32), dtype="float32")]
    check_outputs((torch.zeros(2, 32),), promised)
    with pytest.raises(RuntimeError, match=r"output 0 of the stage is .*bfloat16.* but the plan sends .*float32"):
        check_outputs((torch.zeros(2, 32, dtype=torch.bfloat16),), promised)


def _solver_peaks(options: CompileOptions, plan: Plan) -> tuple[int, int]:
    """The cut solver's peak for ``plan``'s cuts, with and without what its recompute rebuilds."""
    from autopart.solve.assemble import pipeline_problem
    from autopart.solve.cut_problem import evaluate

    front = compile_plan(options)[1]
    problem = pipeline_problem(options, front, plan.schedule.microbatches)
    cuts = tuple(stage.blocks[1] for stage in plan.stages[:-1])
    bare = replace(problem, block_rebuilt_bytes=(), rebuilt_at_once=())
    return max(evaluate(problem, cuts).rank_memory_bytes), max(evaluate(bare, cuts).rank_memory_bytes)


def test_a_plan_whose_recompute_outgrows_the_memory_is_refused(tmp_path, capsys):
    """Full recompute under a split backward rebuilds a whole stage's activations in backward.
    The cut solver holds them, and the plan's memory holds them and the stage inputs that
    checkpoint keeps besides. A limit below the solver's figure (and above what it was without
    them) is refused by the solver, one between it and the plan's peak by the check of the plan;
    just above the peak, it is written."""
    options = CompileOptions(model=GPT, microbatches=2, recompute="full", schedule="zb-h1")
    plan = compile_to_directory(options, tmp_path / "a")[0]
    peak = max(plan.predicted.memory_bytes)
    solver, without = _solver_peaks(options, plan)
    assert without + 64 < solver < peak - 64
    base = ["compile", str(GPT), "--microbatches", "2", "--recompute", "full", "--schedule", "zb-h1"]
    for limit, said in ((peak - 64, f"the plan needs {peak / 2**30:.2f} GiB on pipeline rank"),
                        (solver - 64, "the model does not fit")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*base, "-o", str(tmp_path / "b"), "--memory", f"{limit / 2**30:.9f}"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
        assert not (tmp_path / "b").exists()
    cli.main([*base, "-o", str(tmp_path / "c"), "--memory", f"{(peak + 4096) / 2**30:.9f}"])  # room for it: written
    assert (tmp_path / "c" / "plan.json").exists()


def test_a_written_plan_fits_whatever_the_limit(tmp_path):
    """Two stages under full recompute: at limits about the unconstrained plan's peak the solver
    moves the cut, or the compile is refused; no plan is written above its limit."""
    options = CompileOptions(model=GPT, pp=2, microbatches=2, recompute="full")
    plan = compile_to_directory(options, tmp_path / "a")[0]
    peak = max(plan.predicted.memory_bytes)
    solver, _ = _solver_peaks(options, plan)
    for i, limit in enumerate((peak - 64, (peak + solver) // 2, solver - 64, solver * 9 // 10)):
        try:
            written, _ = compile_to_directory(CompileOptions(model=GPT, pp=2, microbatches=2, recompute="full",
                                                             memory_gib=limit / 2**30), tmp_path / f"o{i}")
        except autopart.AutopartError:
            continue
        assert max(written.predicted.memory_bytes) <= limit
