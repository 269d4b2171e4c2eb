"""Golden files: what autopart writes for each example, compared whole with a reviewed copy.

Like torch.distributed.pipelining's schedule artifacts, ``tests/golden/<example>/`` holds the
first stage program, the plan and the schedule of ``autopart compile <example> --pp 2
--microbatches 4 --device a100-80gb``. The roofline device makes every predicted time a
function of the model alone, not of this machine's measured speed, so the files are the same
on any machine. A change to code generation, planning or scheduling shows here as a diff to
review; when it is intended, rewrite them with::

    AUTOPART_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from tests.distributed import REPO

GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = ("gpt", "llama")

VOLATILE = ("torch_version", "autopart_version", "bound_s", "gap")
"""Provenance that says where and with what a plan was made, not what it is."""


def normalised_plan(out: Path) -> str:
    """plan.json without what differs between two compiles of the same plan: paths, versions, the
    solver's bound (an optimal plan's objective is fixed; the bound it proved varies), the stage
    files' hashes (their docstrings name the output directory), and the error band of its basis
    (the last accuracy benchmark's, `autopart/predict/accuracy.json`)."""
    plan = json.loads((out / "plan.json").read_text())
    provenance = plan["provenance"]
    provenance["model_file"] = Path(provenance["model_file"]).relative_to(REPO).as_posix()
    for key in VOLATILE:
        provenance[key] = "<volatile>"
    plan["stage_sha256"] = {name: "<sha256>" for name in plan["stage_sha256"]}
    for key in ("error_median", "error_worst", "error_benchmark"):
        plan["predicted"][key] = "<benchmarked>"
    return json.dumps(plan, indent=2) + "\n"


def generated(example: str, tmp_path: Path) -> dict[str, str]:
    options = CompileOptions(model=REPO / "examples" / f"{example}.py", pp=2, microbatches=4, device="a100-80gb")
    _, out = compile_to_directory(options, tmp_path / "out")
    stage = (out / "stages" / "stage_0.py").read_text().replace(str(out), "OUT")
    return {"stage_0.py": stage, "plan.json": normalised_plan(out), "schedule.csv": (out / "schedule.csv").read_text()}


@pytest.mark.parametrize("example", EXAMPLES)
def test_generated_files_match_the_golden_ones(tmp_path, example):
    for name, text in generated(example, tmp_path).items():
        path = GOLDEN / example / name
        if os.environ.get("AUTOPART_UPDATE_GOLDEN") == "1":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            continue
        assert path.is_file(), f"no {path}; write it with AUTOPART_UPDATE_GOLDEN=1 and review it"
        expected = path.read_text()
        if text != expected:
            diff = "".join(difflib.unified_diff(
                expected.splitlines(True), text.splitlines(True), f"tests/golden/{example}/{name}", "generated", n=2
            ))  # fmt: skip
            pytest.fail(f"{name} differs from its golden file (AUTOPART_UPDATE_GOLDEN=1 rewrites it):\n{diff[:6000]}")


def test_the_golden_stage_programs_write_a_layer_once():
    """What the golden files must show to be worth keeping: each layer's code once, called per layer."""
    for example, method, container in (("gpt", "block", "h"), ("llama", "transformer_block", "layers")):
        source = (GOLDEN / example / "stage_0.py").read_text()
        assert source.count(f"    def {method}(self, x, layer):") == 1, example
        assert f"x = self.{method}(x, self.{container}[0])" in source, example
        assert "torch._C" not in source and "getattr(self" not in source and "= None" not in source, example
