"""``compile --plan``: a hand-edited plan is checked whole, against the schema and the model.

Every field that decides the programs must agree with the model and with the plan's other
fields; the first one that does not is named in one line. The property test edits one field of a
valid plan at random: the compile either refuses in one line or writes the programs of a plan
that decides the same, which ``autopart verify`` passes.
"""

import ast
import copy
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from autopart.tools import cli
from autopart.ir.plan import load_plan
from autopart.ir.plan_difference import first_difference
from tests.distributed import REPO

TINY_GPT = REPO / "tests" / "models" / "tiny_gpt.py"
FIXED_COSTS = ["--device", "h100-sxm"]  # roofline figures: the same plan and sources on every machine


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "out"
    cli.main(["compile", str(TINY_GPT), "-o", str(out), "--pp", "2", "--microbatches", "2", "--global-batch-size", "4",
              "--time-limit", "5", *FIXED_COSTS])
    return out


def compile_edited(tmp_path: Path, capsys, data: dict) -> tuple[int, str, Path]:
    """Compile ``data`` as ``--plan``: the exit code, stderr, and the output directory."""
    plan = tmp_path / "edited.json"
    plan.write_text(json.dumps(data))
    out = tmp_path / "out"
    try:
        cli.main(["compile", str(TINY_GPT), "-o", str(out), "--plan", str(plan), *FIXED_COSTS])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err, out


def refused(tmp_path: Path, capsys, data: dict) -> str:
    code, err, out = compile_edited(tmp_path, capsys, data)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("autopart: error: "), err
    assert not out.exists()
    return lines[0]


def test_rank_5_on_a_2_stage_plan_is_named(original, tmp_path, capsys):
    data = json.loads((original / "plan.json").read_text())
    data["stages"][1]["rank"] = 5
    line = refused(tmp_path, capsys, data)
    assert "plan.stages[1].rank is 5 but plan.mesh.pp is 2" in line, line


@pytest.mark.parametrize("edit, named", [
    (lambda d: d["stages"][0].update(rank=1), r"plan\.stages\[0\]\.rank is 1 but this model .* give 0"),
    (lambda d: d["stages"][0].update(index=1), r"plan\.stages\[0\]\.index is 1"),
    (lambda d: d["stages"][1].update(blocks=[1, 1]), r"plan\.stages\[1\]\.blocks is \[1, 1\] but"),
    (lambda d: d["stages"][0]["inputs"].append(["x", {"shape": [1], "dtype": "float32"}]), r"plan\.stages\[0\]\.inputs"),
    (lambda d: d["stages"][0]["strategies"].update(linear="col"), r"plan\.stages\[0\]\.strategies"),
    (lambda d: d["stages"][1]["parameters"].pop(), r"plan\.stages\[1\]\.parameters"),
    (lambda d: d["stages"][0]["nodes"].insert(0, "nowhere"), r"plan\.stages\[0\]\.nodes"),
    (lambda d: d["mesh"].update(pp=0), r"plan\.mesh\.pp must be at least 1"),
    (lambda d: d["mesh"].update(pp=3), r"plan\.stages lists 2 stages but plan\.mesh\.pp x plan\.schedule\.chunks is 3 x 1"),
    (lambda d: d["mesh"].update(dp=2), r"plan\.schedule\.micro_batch_size is 2 but .* give 1"),
    (lambda d: d["schedule"].update(kind="zigzag"), r"unknown schedule 'zigzag'"),
    (lambda d: d["schedule"].update(micro_batch_size=3), r"plan\.schedule\.micro_batch_size is 3"),
    (lambda d: d.update(dtype="fp16"), r"plan\.dtype must be one of fp32, bf16"),
    (lambda d: d.update(gpus_per_node=0), r"plan\.gpus_per_node must be at least 1, got 0"),
    (lambda d: d.update(graph_inputs=["x"]), r"plan\.graph_inputs is \[\"x\"\]"),
    (lambda d: d["tied_parameters"].clear(), r"plan\.tied_parameters is \{\}"),
    (lambda d: d["provenance"].update(capture="export"), r"plan\.(tied_parameters|stages\[0\]\.\w+) is"),  # names differ
])
def test_an_inconsistent_field_is_named_in_one_line(original, tmp_path, capsys, edit, named):
    data = json.loads((original / "plan.json").read_text())
    edit(data)
    line = refused(tmp_path, capsys, data)
    assert re.search(named, line), line


def _leaves(value, path=()):
    """Every field of a plan's JSON as a path of keys and indices, scalars and whole containers alike."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, index))


def _edited(value, choice: int):
    """One of a few changes of a JSON value of any type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return [value + 1, value - 1, 0, -1, 2 * value + 3][choice % 5]
    if isinstance(value, float):
        return [value * 2, -value, 0.0][choice % 3]
    if isinstance(value, str):
        return [value + "x", "", "fp32", "gpipe"][choice % 4]
    if isinstance(value, list):
        return [value[:-1], value + value[-1:], []][choice % 3]
    if isinstance(value, dict):
        return [{}, {**value, "extra": 1}][choice % 2]
    return 0


def _programs(out: Path) -> tuple:
    """What the ranks run: the decided plan, the stage sources without their docstrings, the weights."""
    sources = [ast.dump(ast.Module(ast.parse(p.read_text()).body[1:], [])) for p in sorted((out / "stages").glob("*.py"))]
    weights = {p.name: {k: v.tolist() for k, v in load_file(str(p)).items()} for p in sorted((out / "weights").iterdir())}
    return sources, weights


@pytest.mark.multiprocess
def test_a_random_single_field_edit_is_refused_or_compiles_to_a_verified_program(original, tmp_path_factory, capsys):
    """Hypothesis picks a field and an edit; an accepted edit's programs are the original's (checked
    whole) and so are verified once: the first accepted edit whose plan decides anything differently
    from the original's, or else the original."""
    data = json.loads((original / "plan.json").read_text())
    data.pop("stage_sha256")  # set by the emit; a plan given with --plan may omit it
    paths = [p for p in _leaves(data) if p]
    expected = _programs(original)
    verified: list[Path] = []
    outcomes: list[str] = []

    @settings(max_examples=14, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.sampled_from(paths), st.integers(0, 59), st.booleans())
    def check(path, choice, delete):
        edited = copy.deepcopy(data)
        holder = edited
        for key in path[:-1]:
            holder = holder[key]
        if delete and isinstance(holder, dict):
            del holder[path[-1]]
        else:
            holder[path[-1]] = _edited(holder[path[-1]], choice)
        folder = tmp_path_factory.mktemp("edit")
        code, err, out = compile_edited(folder, capsys, edited)
        if code != 0:
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1 and "Traceback" not in err, (path, err)
            assert not out.exists()
            outcomes.append("refused")
            return
        outcomes.append("compiled")
        assert _programs(out) == expected, path
        if first_difference(load_plan(original / "plan.json"), load_plan(out / "plan.json")) is not None and not verified:
            verified.append(out)

    check()
    assert set(outcomes) == {"refused", "compiled"}, outcomes  # both branches were taken
    print(f"{outcomes.count('refused')} refused, {outcomes.count('compiled')} compiled, "
          f"verified {'an edited plan' if verified else 'the original'}")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["verify", str(verified[0] if verified else original), "--steps", "1"])
    assert exit_info.value.code == 0, capsys.readouterr()


def test_a_stage_s_nodes_are_named_where_they_differ(original, tmp_path, capsys):
    """The whole list, cut at 80 characters, read the same in the plan and in the model's."""
    data = json.loads((original / "plan.json").read_text())
    kept = data["stages"][0]["nodes"][5]
    data["stages"][0]["nodes"][5] = "elsewhere"
    line = refused(tmp_path, capsys, data)
    assert f'plan.stages[0].nodes[5] is "elsewhere" but this model and the plan\'s other fields give "{kept}"' in line, line


@pytest.mark.parametrize("cost_model, fix", [
    ("roofline:a100-80gb", "pass its --device"),
    ("profiled:h100-sxm", "compile with its --costs, or measuring, as it was"),  # the device was the same
])  # fmt: skip
def test_a_plan_costed_otherwise_is_told_what_differs(original, tmp_path, capsys, cost_model, fix):
    data = json.loads((original / "plan.json").read_text())
    data["mesh"]["dp"] = 2
    data["provenance"]["cost_model"] = cost_model
    line = refused(tmp_path, capsys, data)
    assert f"(it was costed with {cost_model}, this compile with roofline:h100-sxm: {fix})" in line, line
