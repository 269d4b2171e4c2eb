"""``benchmarks/gpu_check.py`` on the CPU (gloo), prepared and run as on a GPU machine, so that the
one script a GPU session runs keeps working between GPU sessions."""

import sys
from pathlib import Path

import pytest

from tests.distributed import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

pytestmark = pytest.mark.multiprocess

MODEL = REPO / "tests" / "models" / "three_layers.py"


def test_gpu_check_prepares_and_runs_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = MODEL
    prepared = tmp_path / "prepared"
    assert gpu_check.main(["--prepare", str(prepared), "--device", "cpu", "--model", str(model)]) == 0
    assert sorted(p.name for p in prepared.iterdir()) == sorted([*gpu_check.PLANS, "check.json", "roofline",
                                                                 "roofline_model.py"])
    assert gpu_check.main(["--run", str(prepared), "--steps", "2"]) == 0
    table = capsys.readouterr().out
    for check in ("fp32: 2 steps", "bf16: 2 steps", "interleaved: 2 stages on 1 rank", "predicted step",
                  "zb-dropout-full: full recompute, 2 steps, losses = one process",
                  "predicted peak memory", "matmul efficiency",
                  "cpu roofline plan (", "predicted step vs measured median",
                  "ok    batches drawn on cpu apart from training's seeds"):  # fmt: skip
        assert check in table, table
    assert f"0 failed of {len(gpu_check.PLANS) + 1} judged checks" in table, table  # the plans' losses, the draws
