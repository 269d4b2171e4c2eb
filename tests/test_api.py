"""The Python API and the plan as a value: compile, emit, save, load, pin."""

import dataclasses
import json
import random
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

import autopart
from autopart.ir.model_file import eager_loss, load_model_file
from autopart.driver import CompileOptions, compile_to_directory, random_state_kept
from autopart.ir.errors import ConfigError, ModelFileError, PlanError
from autopart.ir.plan import Plan, load_plan
from autopart.runtime.reference import initial_weights
from autopart.runtime.stage import load_stage
from tests.distributed import FREE_LINKS
from tests.stage_chain import chained_loss

REPO = Path(__file__).resolve().parent.parent
GPT = REPO / "examples" / "gpt.py"
TINY_GPT = REPO / "tests" / "models" / "tiny_gpt.py"


@pytest.fixture(scope="module")
def plan() -> Plan:
    # the CPU's roofline, not its measured ops: cuts that do not move with the machine (0-5, 6-11)
    return autopart.compile(GPT, pp=2, microbatches=4, micro_batch_size=2, schedule="gpipe", measure=False)


def test_compile_returns_a_plan_that_emits(plan, tmp_path):
    assert isinstance(plan, Plan)
    assert plan.mesh == {"pp": 2, "tp": 1, "dp": 1}
    assert plan.schedule.microbatches == 4 and plan.schedule.global_batch_size == 8
    assert plan.predicted.step_s > 0 and 0 < plan.predicted.bubble < 1
    assert len(plan.predicted.memory_bytes) == 2
    out = autopart.emit(plan, tmp_path / "out")
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == [
        ".autopart-output.json", "model.py", "plan.json", "report.md", "schedule.csv", "stages/stage_0.py",
        "stages/stage_1.py", "timeline.png", "trace.json", "train.py", "weights/stage_0.safetensors",
        "weights/stage_1.safetensors",
    ]  # fmt: skip
    emitted = load_plan(out / "plan.json")
    assert emitted == plan and sorted(emitted.stage_sha256) == ["stages/stage_0.py", "stages/stage_1.py"]


def test_every_node_is_in_exactly_one_stage(plan):
    nodes = [n for stage in plan.stages for n in stage.nodes]
    assert len(nodes) == len(set(nodes))
    assert plan.stages[0].blocks[0] == 0
    assert plan.stages[0].blocks[1] + 1 == plan.stages[1].blocks[0]


def test_emitted_stages_run_one_after_the_other_as_the_model(plan, tmp_path):
    """The round trip through the API that runs: the two emitted stages, loaded as a rank loads
    them and chained in this process, give the original model's loss and gradients on a batch."""
    out = autopart.emit(plan, tmp_path / "out")
    source = (out / "stages" / "stage_1.py").read_text()
    assert "torchrun --nproc-per-node 2" in source and "layer.mlp.c_fc.weight" in source  # readable: module paths
    assert "x = self.block(x, self.h[3])" in source and "def block(self, x, layer):" in source  # h.3 as a call
    stages = [load_stage(out, s.index, torch.device("cpu")) for s in plan.stages]
    spec = load_model_file(GPT)
    spec.module.load_state_dict(initial_weights(out), strict=False)
    inputs, target = spec.example(plan.schedule.micro_batch_size)
    loss = chained_loss(stages, plan, inputs, target)
    loss.backward()
    expected = eager_loss(spec, inputs, target)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    gradients: dict[str, torch.Tensor] = {}
    for module in stages:  # a tied weight is held by both stages: its gradient is the sum of theirs
        for name, parameter in module.named_parameters():
            gradients[name] = gradients.get(name, 0) + parameter.grad
    for name, parameter in spec.module.named_parameters():
        torch.testing.assert_close(gradients[name], parameter.grad, msg=name)


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


def _model_with_a_sibling(folder: Path) -> Path:
    """A model file that imports a file beside it (``from layers import Block``) of width 16."""
    (folder / "layers.py").write_text("import torch\nWIDTH = 16\nclass Block(torch.nn.Linear):\n"
                                      "    def __init__(self):\n        super().__init__(8, WIDTH)\n")
    model = folder / "model.py"
    model.write_text("import torch\nfrom layers import Block, WIDTH\n"
                     "def build_model():\n    return torch.nn.Sequential(Block(), torch.nn.Linear(WIDTH, 4))\n"
                     "def example_batch(b):\n    return (torch.randn(b, 8),), torch.randn(b, 4)\n"
                     "def loss_fn(out, target):\n    return ((out - target) ** 2).mean()\n")  # fmt: skip
    return model


def _widen(folder: Path) -> None:
    (folder / "layers.py").write_text((folder / "layers.py").read_text().replace("WIDTH = 16", "WIDTH = 32"))


def test_a_second_compile_in_one_process_reads_the_model_s_sibling_files_as_they_are_now(tmp_path):
    """A notebook that edits a file the model imports and compiles again gets the model as it is
    now, not the first import's."""
    model = _model_with_a_sibling(tmp_path)

    def parameters() -> int:
        return sum(s.parameter_bytes for s in autopart.compile(model, pp=1, microbatches=1, measure=False).stages)

    first = parameters()
    _widen(tmp_path)
    assert parameters() == first * 2 - 4 * 4  # (8*W + W + W*4 + 4) * 4 bytes: W 16 -> 32


@pytest.mark.multiprocess
def test_verify_of_a_model_changed_since_its_compile_says_so_in_one_line(tmp_path):
    from autopart.ir.errors import ConfigError
    from autopart.tools.verify import verify

    out = tmp_path / "out"
    autopart.emit(autopart.compile(_model_with_a_sibling(tmp_path), pp=2, microbatches=2, measure=False), out)
    _widen(tmp_path)
    with pytest.raises(ConfigError, match=r"model\.py now builds '0\.\w+' of shape \(32.*\), where .* was compiled "
                                          r"with \(16.*\) \(a file it imports changed\?\); compile it again"):
        verify(out, steps=1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("signature", ["idx, temperature=2.0, targets=None", "idx, *, temperature=2.0"])
def test_forward_arguments_left_to_their_defaults_are_traced_at_them(tmp_path, signature):
    """An input that example_batch() does not give, positional or keyword-only, is fixed at its
    default by torch.fx, which kept it as an input of the graph beside a check of its value: the
    compile refused the model (2 inputs, 1 given)."""
    from autopart.tools.verify import verify

    model = tmp_path / "defaults.py"
    model.write_text(
        "import torch\n"
        "class Model(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.emb, self.mid, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)\n"
        f"    def forward(self, {signature}):\n"
        "        return self.head(torch.tanh(self.mid(self.emb(idx)))) / temperature\n"
        "def build_model():\n    torch.manual_seed(0)\n    return Model()\n"
        "def example_batch(b):\n    g = torch.Generator().manual_seed(0)\n"
        "    return (torch.randint(0, 16, (b, 4), generator=g),), torch.randint(0, 16, (b, 4), generator=g)\n"
        "def loss_fn(out, target):\n    return torch.nn.functional.cross_entropy(out.reshape(-1, 16), target.reshape(-1))\n"
    )  # fmt: skip
    out = tmp_path / "out"
    autopart.emit(autopart.compile(model, pp=2, microbatches=2, capture="fx", measure=False), out)
    assert "/ 2.0" in "".join(p.read_text() for p in (out / "stages").glob("*.py"))
    result = verify(out, steps=2)
    assert result.matches, result.failures[:3]


def test_options_given_in_another_form_are_taken_as_the_command_line_takes_them():
    options = autopart.CompileOptions(model=str(TINY_GPT), costs="costs.json", leaf="Block", pp=2,
                                      stage_layers="1,1", time_limit_s=5, dp=2, zero=True)
    assert options.model == TINY_GPT and options.costs == Path("costs.json")  # a str path is a Path, as for plan=
    assert options.leaf == ("Block",) and options.stage_layers == (1, 1)  # one class; --stage-layers 1,1
    assert options.time_limit_s == 5.0 and options.zero == 1
    assert autopart.CompileOptions(model=TINY_GPT, leaf=["Block", "MLP"]).leaf == ("Block", "MLP")
    per_stage = autopart.CompileOptions(model=TINY_GPT, pp=2, recompute="full,none", device=Path("h100-sxm.toml"))
    assert per_stage.recompute == ("full", "none") and per_stage.device == "h100-sxm.toml"  # --recompute full,none
    assert autopart.CompileOptions(model=TINY_GPT, pp=2, recompute="full, none").recompute == ("full", "none")


@pytest.mark.parametrize("given, message", [
    ({"pp": "2"}, r"pp must be a whole number, got '2' \(str\); pass pp=2"),
    ({"pp": 2.0}, r"pp must be a whole number, got 2\.0 \(float\); pass pp=2"),
    ({"pp": True}, r"pp must be a whole number, got True \(bool\)"),
    ({"sp": 1}, r"sp must be True or False, got 1 \(int\)"),
    ({"memory_gib": "40"}, r"memory_gib must be a number, got '40' \(str\); pass memory_gib=40\.0"),
    ({"leaf": [1]}, r"leaf must be a tuple of str \(or one str\), got \[1\] \(list\)"),
    ({"pp": 2, "stage_layers": "2,x"}, r"stage_layers must be a tuple of whole numbers \(or a str of them .*'2,x' \(str\)"),
    ({"costs": 3}, r"costs must be a path \(a str or pathlib\.Path\), got 3 \(int\)"),
])
def test_an_option_of_another_type_is_refused_in_one_line(given, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        autopart.CompileOptions(model=TINY_GPT, **given)


def test_every_whole_number_option_refuses_a_str_a_float_and_a_bool():
    annotations = typing.get_type_hints(autopart.CompileOptions)
    whole = [name for name, annotation in annotations.items() if int in typing.get_args(annotation) + (annotation,)]
    assert {"pp", "tp", "dp", "zero", "microbatches", "chunks", "gpus_per_node", "first_stage_layers"} <= set(whole)
    for name in whole:
        allows_bool = bool in typing.get_args(annotations[name])  # zero: True is ZeRO-1
        for value in ("2", 2.0, *(() if allows_bool else (True,))):
            with pytest.raises(ConfigError, match=f"^{name} must be a whole number"):
                autopart.CompileOptions(model=TINY_GPT, **{name: value})


@pytest.mark.parametrize("given", [{"pp": 2, "sp": True}, {"tp": 1, "world_size": 2, "tp_overlap": True},
                                   {"world_size": 2, "dp": 2, "tp_overlap": True, "global_batch_size": 4}])
def test_sequence_parallelism_asked_without_tensor_parallelism_is_refused(given):
    """The plan would have none, without a word: TP 1 (pinned, or all the pinned pp and dp
    leave) has nothing to split."""
    with pytest.raises(ConfigError, match=r"splits what tensor parallelism computes, and this compile has none"):
        autopart.compile(TINY_GPT, microbatches=2, measure=False, **given)


@pytest.mark.parametrize("given", [{"tp_overlap": True}, {"sp": True}])
def test_a_search_asked_for_sequence_parallelism_takes_a_layout_with_tensor_parallelism(given):
    """Where TP is searched, --sp or --tp-overlap leaves the search only layouts that have it:
    it took pp 2 at TP 1 and dropped both in silence."""
    plan = autopart.compile(TINY_GPT, world_size=2, global_batch_size=4, device="a100-80gb", measure=False, **given)
    assert plan.mesh["tp"] == 2 and plan.sp and plan.tp_overlap == given.get("tp_overlap", False)
    with pytest.raises(ConfigError, match=r"no layout of 2 devices .* --sp and --tp-overlap need tp 2 or more within a "
                                          r"node, and a replica runs at most 16384 microbatches; relax a pin"):
        autopart.compile(TINY_GPT, world_size=2, global_batch_size=4, device="a100-80gb", gpus_per_node=1, **given)


def test_a_misspelt_option_is_refused_in_one_line_with_the_nearest_name():
    with pytest.raises(ConfigError, match=r"^autopart\.compile has no option 'microbatch'; did you mean microbatches\?$"):
        autopart.compile(TINY_GPT, pp=2, microbatch=2)
    with pytest.raises(ConfigError, match=r"^CompileOptions has no option 'microbatch'; did you mean microbatches\?$"):
        autopart.CompileOptions(model=TINY_GPT, pp=2, microbatch=2)
    with pytest.raises(ConfigError, match=r"^autopart\.compile has no option 'xyzzy'; the options are world_size, "):
        autopart.compile(TINY_GPT, xyzzy=1)


@pytest.mark.parametrize("schedule, pp, dp, global_batch, microbatches", [
    ("zbv", 2, 2, 14, 7),  # 7 per replica: 1 divides it and is too few to fill the V; 7 is the one that runs
    ("interleaved", 2, 1, 6, 2),  # 3 divides 6 but interleaved's rounds take a multiple of 2
    ("1f1b", 2, 1, 6, 3),  # the largest divisor up to two per stage, as before
])
def test_the_default_microbatch_count_is_one_the_schedule_runs(schedule, pp, dp, global_batch, microbatches):
    options = autopart.CompileOptions(model=TINY_GPT, pp=pp, dp=dp, schedule=schedule, global_batch_size=global_batch,
                                      chunks=2 if schedule == "interleaved" else None)
    assert options.batch_shape() == (global_batch, microbatches, global_batch // dp // microbatches)


@pytest.mark.parametrize("schedule, pp, microbatches, nearest", [("interleaved", 4, 3, 4), ("interleaved", 4, 6, 4),
                                                                  ("zbv", 2, 2, 3), ("zbv", 4, 2, 7)])
def test_without_a_global_batch_the_refusal_names_a_count_that_runs(schedule, pp, microbatches, nearest):
    """The global batch follows the counts when it is not given: the hint is the nearest count the
    schedule runs, not a --global-batch-size (which the counts would contradict); and it runs."""
    options = dict(model=TINY_GPT, pp=pp, schedule=schedule, chunks=2, micro_batch_size=2)
    with pytest.raises(ConfigError, match=rf"; use --microbatches {nearest}$"):
        autopart.CompileOptions(**options, microbatches=microbatches).batch_shape()
    assert autopart.CompileOptions(**options, microbatches=nearest).batch_shape() == (2 * nearest, nearest, 2)


def test_emit_of_what_is_not_a_plan_says_what_it_takes(tmp_path):
    with pytest.raises(ConfigError, match=r"^emit takes the Plan that autopart\.compile returns, got '.*plan\.json' "
                                          r"\(str\); for a saved plan\.json, pass autopart\.load_plan\(path\)$"):
        autopart.emit(str(tmp_path / ("a-long-folder-name" * 4) / "plan.json"), tmp_path / "out")  # not cut at 80
    assert list(tmp_path.iterdir()) == []


def test_a_folder_given_as_the_model_is_called_one(tmp_path):
    with pytest.raises(ModelFileError, match=r"model file '.*' is a directory; pass the path of the Python file in it"):
        autopart.compile(tmp_path, measure=False)


def test_compile_and_emit_leave_the_callers_random_state_as_they_found_it(tmp_path):
    """tiny_gpt's build_model seeds torch itself; the caller's next draws are as without the compile."""
    def seeded_draws() -> tuple[list[float], float]:
        return torch.rand(3).tolist(), random.random()

    torch.manual_seed(123)
    random.seed(5)
    expected = seeded_draws()
    torch.manual_seed(123)
    random.seed(5)
    plan = autopart.compile(TINY_GPT, pp=2, microbatches=2, measure=False)
    assert torch.initial_seed() == 123 and seeded_draws() == expected  # the seed was 0, the draws build_model's
    torch.manual_seed(123)
    random.seed(5)
    out = autopart.emit(plan, tmp_path / "out")
    assert torch.initial_seed() == 123 and seeded_draws() == expected
    built = load_model_file(TINY_GPT).module.state_dict()  # the compile's own draws are as they were
    assert all(torch.equal(tensor, built[name]) for name, tensor in initial_weights(out).items())


def test_the_api_imported_on_first_use_leaves_pythons_random_as_it_was():
    """rich, which the compiler imports, draws from Python's random when first imported."""
    code = ("import random, autopart; random.seed(5); state = random.getstate(); autopart.compile; "
            "assert random.getstate() == state")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_a_seed_queued_for_cuda_inside_is_replaced_by_the_callers(monkeypatch):
    """Before CUDA is first used, torch.manual_seed queues its seed for CUDA's generators; the
    model file's seed must not be the one they are made with."""
    queued: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", queued.append)
    torch.manual_seed(123)
    with random_state_kept():
        torch.manual_seed(0)
    assert queued == [123, 0, 123]


@pytest.mark.parametrize("device", ["h100-sxm", str(FREE_LINKS)], ids=["bundled", "toml"])
def test_emit_writes_the_stage_files_the_command_line_writes_for_a_gpu_plan(tmp_path, device):
    """The stage files name each value's dtype, which the device's autocast decides (under bf16 a
    GPU's layer norm runs in fp32): emit costs the plan's device, not this machine's."""
    options = {"pp": 2, "tp": 2, "microbatches": 2, "device": device, "dtype": "bf16"}
    plan, cli = compile_to_directory(CompileOptions(model=TINY_GPT, **options), tmp_path / "cli")
    api = autopart.emit(autopart.compile(TINY_GPT, **options), tmp_path / "api")
    assert plan.provenance.device == device
    for stage in ("stage_0.py", "stage_1.py"):
        written = [(out / "stages" / stage).read_text().replace(str(out), "OUT") for out in (cli, api)]
        assert "float32" in written[0] and written[1] == written[0], stage
    moved = dataclasses.replace(plan, provenance=dataclasses.replace(plan.provenance, device="/nowhere/gpu.toml"))
    with pytest.raises(PlanError, match=r"^the plan was costed for device '/nowhere/gpu\.toml', which cannot be loaded "
                                        r"here; emit it with autopart compile MODEL --plan PLAN\.json --device SPEC\.toml"):
        autopart.emit(moved, tmp_path / "moved")
