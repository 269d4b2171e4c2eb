"""The Python API and the plan as a value: compile, emit, save, load, pin."""

import json
from pathlib import Path

import pytest

import autopart
from autopart.errors import PlanError
from autopart.plan import Plan, load_plan

REPO = Path(__file__).resolve().parent.parent
GPT = REPO / "examples" / "gpt.py"


@pytest.fixture(scope="module")
def plan() -> Plan:
    return autopart.compile(GPT, pp=2, microbatches=4, micro_batch_size=2, schedule="gpipe")


def test_compile_returns_a_plan_that_emits(plan, tmp_path):
    assert isinstance(plan, Plan)
    assert plan.mesh == {"pp": 2, "tp": 1, "dp": 1}
    assert plan.schedule.microbatches == 4 and plan.schedule.global_batch_size == 8
    assert plan.predicted.step_s > 0 and 0 < plan.predicted.bubble < 1
    assert len(plan.predicted.memory_bytes) == 2
    out = autopart.emit(plan, tmp_path / "out")
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == [
        "model.py", "plan.json", "report.md", "schedule.csv", "stages/stage_0.py", "stages/stage_1.py",
        "timeline.png", "trace.json", "train.py", "weights/stage_0.safetensors", "weights/stage_1.safetensors",
    ]  # fmt: skip
    assert load_plan(out / "plan.json") == plan


def test_every_node_is_in_exactly_one_stage(plan):
    nodes = [n for stage in plan.stages for n in stage.nodes]
    assert len(nodes) == len(set(nodes))
    assert plan.stages[0].blocks[0] == 0
    assert plan.stages[0].blocks[1] + 1 == plan.stages[1].blocks[0]


def test_stage_code_is_readable(plan, tmp_path):
    out = autopart.emit(plan, tmp_path / "out")
    source = (out / "stages" / "stage_1.py").read_text()
    assert "torchrun --nproc-per-node 2" in source
    assert "'wte.weight': ((512, 64), torch.float32)" in source  # tied head: original name, held here too
    assert "# h.3.mlp.c_fc" in source  # module paths of the original model
    compile(source, "stage_1.py", "exec")


def test_a_pinned_plan_is_emitted_as_it_is(plan, tmp_path):
    data = plan.to_json()
    first, second = data["stages"]
    # a stage ends after a residual add; two nodes before it the residual is live beside the
    # branch, so no block ends there (five before, where the costs may put the cut, one does)
    moved = first["nodes"][-2:]
    data["stages"][0]["nodes"], data["stages"][1]["nodes"] = first["nodes"][:-2], moved + second["nodes"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="does not end on a block"):
        autopart.compile(GPT, pp=2, microbatches=4, micro_batch_size=2, plan=tmp_path / "bad.json")

    plan.save(tmp_path / "plan.json")
    pinned = autopart.compile(GPT, pp=2, microbatches=4, micro_batch_size=2, plan=tmp_path / "plan.json")
    assert pinned.provenance.solver_status == "pinned"
    assert [s.nodes for s in pinned.stages] == [s.nodes for s in plan.stages]


def test_plan_of_another_model_is_refused(plan, tmp_path):
    data = plan.to_json()
    data["provenance"]["model_sha256"] = "0" * 64
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="another version of gpt.py"):
        autopart.compile(GPT, pp=2, microbatches=4, micro_batch_size=2, plan=tmp_path / "plan.json")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.pop("stages"), r"plan\.stages is missing"),
        (lambda d: d["schedule"].update(microbatches="four"), r"plan\.schedule\.microbatches must be an integer"),
        (lambda d: d.update(version=99), "plan version 99 is not supported"),
    ],
)
def test_malformed_plan_names_the_field(plan, edit, message):
    data = plan.to_json()
    edit(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_json(data)
