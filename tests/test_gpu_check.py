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


def test_rows_of_another_gpu_s_spec_are_judged_against_the_gpu_at_hand_or_not_at_all():
    """Plans prepared for the h200, run on an H100: the roofline plan's predictions are the h200's
    and are not judged; the GEMMs are judged against the H100's own spec, and printed unjudged on
    a GPU without a spec. A torch of another major.minor than the plans' is warned about."""
    known = ["cpu", "h100-sxm", "h200"]
    same = gpu_check.judging("cuda", "h200", "h200", known, "2.13.0", "2.13.1+cu126")
    assert (same.gemm_spec, same.gemms, same.roofline, same.warnings) == ("h200", True, True, ())
    other = gpu_check.judging("cuda", "h200", "h100-sxm", known, "2.13.0", "2.13.0")
    assert (other.gemm_spec, other.gemms, other.roofline) == ("h100-sxm", True, False)
    assert len(other.warnings) == 1 and "prepared for h200, this GPU is h100-sxm" in other.warnings[0]
    unknown = gpu_check.judging("cuda", "h200", "nvidia-l40s", known, "2.13.0", "2.11.0+cu126")
    assert (unknown.gemm_spec, unknown.gemms, unknown.roofline) == ("h200", False, False)
    assert any("compiled under torch 2.13.0, this is torch 2.11.0+cu126" in w for w in unknown.warnings)
    cpu = gpu_check.judging("cpu", "cpu", "cpu", known, "2.13.0", "2.13.0")
    assert (cpu.gemms, cpu.roofline, cpu.warnings) == (False, False, ())
