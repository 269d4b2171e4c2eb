"""Every predicted step carries its basis and the band of error that the shipped accuracy file
records for it (`autopart/predict/accuracy.json`, written by the benchmarks): only on the devices,
precisions and layouts its rows ran, and an MFU beside a 16-bit accelerator plan's step, never
above the ceiling the best published runs reach. (tests/test_measure_defaults.py: what the
default compile measures, and when.)"""

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

import autopart
import cost_models
from autopart.predict import accuracy
from autopart.predict.accuracy import Band, basis_for, load_bands, write_band
from autopart.tools.cli import main
from autopart.ir.plan import load_plan
from cost_models.database import CostDatabase

MODEL = Path(__file__).parent / "models" / "three_layers.py"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own: the named devices' plans below measure nothing into it."""
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def bands_file(path: Path, median: float, worst: float) -> Path:
    band = Band(median=median, worst=worst, rows=6, benchmark="cost_accuracy", command="python x.py", date="2026-12-01")
    write_band("cpu-measured", band, path)
    write_band("spec-roofline", Band(**{**asdict(band), "benchmark": "published_runs"}), path)
    return path


def test_the_printed_step_carries_the_band_of_the_shipped_file(cache_dir, tmp_path, monkeypatch, capsys) -> None:
    bands = bands_file(tmp_path / "accuracy.json", 0.06, 0.12)
    monkeypatch.setattr(accuracy, "ACCURACY_FILE", bands)
    out = tmp_path / "out"
    main(["compile", str(MODEL), "-o", str(out), "--pp", "2", "--microbatches", "2", "--device", "h100-sxm"])
    lines = capsys.readouterr().out.splitlines()
    printed = " ".join(" ".join(lines).split())
    assert "(h100-sxm roofline; published_runs: median 6%, worst 12%)" in printed
    # into a pipe, as here, a line stays whole (for grep)
    step = next(line for line in lines if line.startswith("predicted step"))
    assert len(step) > 80 and "capture fx" in step
    plan = load_plan(out / "plan.json")
    assert (plan.predicted.error_median, plan.predicted.error_worst) == (0.06, 0.12)
    assert "published_runs: median 6%, worst 12%" in (out / "report.md").read_text()
    main(["explain", str(out)])
    assert "median 6%, worst 12%" in " ".join(capsys.readouterr().out.split())

    bands_file(bands, 0.09, 0.31)  # the benchmark ran again: the next compile says so
    main(["compile", str(MODEL), "-o", str(out), "--pp", "2", "--microbatches", "2", "--device", "h100-sxm"])
    assert "median 9%, worst 31%" in " ".join(capsys.readouterr().out.split())


def test_a_band_holds_only_on_the_devices_and_precision_its_rows_ran_on(cache_dir, tmp_path, monkeypatch,
                                                                       capsys) -> None:
    """published_runs' rows ran in bf16 on A100s and H100s: an MI300X plan, or an fp32 one, has no
    band of its own, and says so, where it printed theirs."""
    bands = tmp_path / "accuracy.json"
    write_band("spec-roofline", Band(median=0.06, worst=0.12, rows=6, benchmark="published_runs", command="x",
                                     date="2026-12-01", covers=("h100-sxm/bf16",)), bands)  # fmt: skip
    monkeypatch.setattr(accuracy, "ACCURACY_FILE", bands)
    printed = {}
    for device, dtype in (("h100-sxm", "bf16"), ("h100-sxm", "fp32"), ("mi300x", "bf16")):
        main(["compile", str(MODEL), "-o", str(tmp_path / f"{device}-{dtype}"), "--pp", "2", "--microbatches", "2",
              "--device", device, "--dtype", dtype])  # fmt: skip
        printed[device, dtype] = " ".join(capsys.readouterr().out.split())
    assert "(h100-sxm roofline; published_runs: median 6%, worst 12%)" in printed["h100-sxm", "bf16"]
    assert "(h100-sxm roofline; no benchmark has measured the error of this basis yet)" in printed["h100-sxm", "fp32"]
    assert "(mi300x roofline; no benchmark has measured the error of this basis yet)" in printed["mi300x", "bf16"]
    assert load_plan(tmp_path / "mi300x-bf16" / "plan.json").predicted.error_median is None


def _printed_by_layout(tmp_path, capsys, prefix: str) -> dict[tuple[int, int], str]:
    """What compile prints for an H100 plan of pp 2, dp 2 and pp 2 x dp 2, into OUT ``{prefix}pp{P}-dp{D}``."""
    printed = {}
    for pp, dp in ((2, 1), (1, 2), (2, 2)):
        main(["compile", str(MODEL), "-o", str(tmp_path / f"{prefix}pp{pp}-dp{dp}"), "--pp", str(pp), "--dp", str(dp),
              "--microbatches", "2", "--device", "h100-sxm"])  # fmt: skip
        printed[pp, dp] = " ".join(capsys.readouterr().out.split())
    return printed


def test_a_band_holds_only_for_the_layouts_its_rows_ran(cache_dir, tmp_path, monkeypatch, capsys) -> None:
    """cost_accuracy's rows are pipelines: a pp x dp plan on this CPU printed their band (worst
    13%) and ran 34% off it, its gradient reduction and its ranks' sharing of the cores priced by
    figures no row checked. A plan of a layout the band's rows did not run has none, and says so."""
    bands = tmp_path / "accuracy.json"
    write_band("spec-roofline", Band(median=0.06, worst=0.12, rows=6, benchmark="published_runs", command="x",
                                     date="2026-12-01", layouts=("pp",)), bands)  # fmt: skip
    monkeypatch.setattr(accuracy, "ACCURACY_FILE", bands)
    printed = _printed_by_layout(tmp_path, capsys, "")
    assert "(h100-sxm roofline; published_runs: median 6%, worst 12%)" in printed[2, 1]
    assert "(h100-sxm roofline; no band for dp plans: published_runs's rows ran pp plans alone)" in printed[1, 2]
    assert "no band for pp+dp plans: published_runs's rows ran pp plans alone" in printed[2, 2]
    plan = load_plan(tmp_path / "pp2-dp2" / "plan.json")
    assert plan.predicted.error_median is None and accuracy.layout_of(plan) == "pp+dp"
    assert "no band for pp+dp plans" in accuracy.describe_prediction(plan)  # as read back from plan.json
    # rows of pp x dp measured apart: their band is that layout's, and the others name both
    write_band("spec-roofline@pp+dp", Band(median=0.2, worst=0.3, rows=2, benchmark="published_runs", command="x",
                                           date="2026-12-01", layouts=("pp+dp",)), bands)  # fmt: skip
    printed = _printed_by_layout(tmp_path, capsys, "again-")
    assert "(h100-sxm roofline; published_runs: median 6%, worst 12%)" in printed[2, 1]
    assert "no band for dp plans: published_runs's rows ran pp and pp+dp plans alone" in printed[1, 2]
    assert "(h100-sxm roofline; published_runs: median 20%, worst 30%)" in printed[2, 2]
    assert load_plan(tmp_path / "again-pp2-dp2" / "plan.json").predicted.basis_key == "spec-roofline@pp+dp"


def test_the_shipped_cpu_bands_hold_for_the_layouts_their_rows_ran() -> None:
    for key in ("cpu-measured", "cpu-measured-pipeline"):
        band = load_bands()[key]
        assert band.holds_for_layout("pp") and not band.holds_for_layout("pp+dp"), key
    # the published runs: pp+tp+dp, and ZeRO-3 over data parallelism alone
    assert load_bands()["spec-roofline"].holds_for_layout("pp+tp+dp")
    assert not load_bands()["spec-roofline"].holds_for_layout("tp+dp")
    assert load_bands()["spec-roofline-zero3"].holds_for_layout("dp")
    assert not load_bands()["spec-roofline-zero3"].holds_for_layout("pp+dp")
    assert load_bands()["spec-roofline"].zero == (1,) and load_bands()["spec-roofline-zero3"].zero == (3,)


def test_into_a_pipe_a_search_table_keeps_each_row_on_one_line(cache_dir, tmp_path, capsys) -> None:
    """rich draws a table at most as wide as its console, 80 columns where the output is not a
    terminal, and wraps cells to fit: the search table (wider than 80) must not."""
    out = tmp_path / "out"
    main(["compile", str(MODEL), "-o", str(out), "--world-size", "4", "--global-batch-size", "8",
          "--device", "h100-sxm"])
    lines = capsys.readouterr().out.splitlines()
    ranked = load_plan(out / "plan.json").provenance.search["ranked"]
    assert len(ranked) >= 2
    for rank, row in enumerate(ranked, start=1):
        assert any(f"│ {rank} │" in line and f" {row['layout']} │" in line for line in lines), row["layout"]
    assert max(len(line) for line in lines if line.startswith("┏")) > 80


def test_a_zero3_plan_carries_the_band_of_the_zero3_rows(cache_dir, tmp_path, monkeypatch, capsys) -> None:
    """A plan that gathers its layers for every forward and backward is off by other amounts than
    the rest: where the benchmark measured its rows apart, a ZeRO-3 plan prints their band."""
    bands = bands_file(tmp_path / "accuracy.json", 0.06, 0.12)
    write_band("spec-roofline-zero3", Band(median=0.4, worst=0.6, rows=3, benchmark="published_runs, its ZeRO-3 rows",
                                           command="python x.py", date="2026-12-04"), bands)
    monkeypatch.setattr(accuracy, "ACCURACY_FILE", bands)
    common = ["--pp", "1", "--microbatches", "2", "--device", "h100-sxm"]
    main(["compile", str(MODEL), "-o", str(tmp_path / "z3"), "--dp", "2", "--zero", "3", *common])
    main(["compile", str(MODEL), "-o", str(tmp_path / "z1"), "--dp", "2", "--zero", "1", *common])
    printed = " ".join(capsys.readouterr().out.split())
    assert printed.count("(h100-sxm roofline; published_runs, its ZeRO-3 rows: median 40%, worst 60%)") == 1
    assert printed.count("(h100-sxm roofline; published_runs: median 6%, worst 12%)") == 1
    zero3 = load_plan(tmp_path / "z3" / "plan.json").predicted
    assert (zero3.basis_key, zero3.error_median, zero3.error_worst) == ("spec-roofline-zero3", 0.4, 0.6)
    assert load_plan(tmp_path / "z1" / "plan.json").predicted.basis_key == "spec-roofline"
    write_band("spec-roofline-zero3", Band(median=0.4, worst=0.6, rows=3, benchmark="published_runs, its ZeRO-3 rows",
                                           command="python x.py", date="2026-12-04", layouts=("dp",)), bands)
    main(["compile", str(MODEL), "-o", str(tmp_path / "z3pp"), "--pp", "2", "--microbatches", "2", "--device",
          "h100-sxm", "--dp", "2", "--zero", "3"])  # its rows ran ZeRO-3 over data parallelism alone
    printed = " ".join(capsys.readouterr().out.split())
    assert ("(h100-sxm roofline; no band for pp+dp plans: published_runs, its ZeRO-3 rows ran dp plans alone)"
            in printed), printed
    write_band("spec-roofline", Band(median=0.06, worst=0.12, rows=6, benchmark="published_runs", command="x",
                                     date="2026-12-04", zero=(1,)), bands)
    for zero in (0, 1, 2):  # FSDP's messages, or ZeRO-0's one all-reduce, where the rows ran ZeRO-1 alone
        main(["compile", str(MODEL), "-o", str(tmp_path / f"z{zero}"), "--dp", "2", "--zero", str(zero), *common])
    printed = " ".join(capsys.readouterr().out.split())
    assert printed.count("(h100-sxm roofline; published_runs: median 6%, worst 12%)") == 1
    for zero in (0, 2):
        assert f"(h100-sxm roofline; no band for ZeRO-{zero} plans: published_runs's rows ran ZeRO-1 plans alone)" \
            in printed, printed


def test_a_basis_no_benchmark_measured_says_so_and_old_plans_load(tmp_path) -> None:
    basis = basis_for(device="cpu", local="cpu", measured=True, costs=None, messages=False, bands={})
    assert basis.describe() == ("(ops measured on this machine, messages from the device spec; "
                                "no benchmark has measured the error of this basis yet)")
    plan = autopart.compile(MODEL, pp=2, microbatches=2, device="a100-80gb")
    data = plan.to_json()
    for name in ("basis", "basis_key", "error_median", "error_worst", "error_benchmark"):
        data["predicted"].pop(name)  # a plan written before the basis was recorded
    (tmp_path / "plan.json").write_text(json.dumps(data))
    assert load_plan(tmp_path / "plan.json").predicted.basis == ""


def test_a_16_bit_step_is_no_faster_than_the_mfu_ceiling_and_says_so(tmp_path) -> None:
    """Wide matrix products on an A100's roofline: the kernels alone give a bf16 step above 60% MFU,
    which no published dense 16-bit run reaches; the plan's step is the ceiling's, and says what
    the kernels gave. fp32 (its own peak) is not bounded, nor a plan under the ceiling."""
    wide = Path(__file__).resolve().parent / "models" / "wide_linears.py"
    options = dict(pp=1, microbatches=32, global_batch_size=128, device="a100-80gb", measure=False)
    plan = autopart.compile(wide, dtype="bf16", **options)
    predicted = plan.predicted
    assert predicted.unbounded_step_s is not None and predicted.unbounded_step_s < predicted.step_s
    assert accuracy.implied_mfu(plan) == pytest.approx(accuracy.MFU_CEILING)
    assert accuracy.mfu_clause(plan) == ""  # the parenthesis says the ceiling's; no second MFU beside it
    unbounded = replace(plan, predicted=replace(predicted, step_s=predicted.unbounded_step_s))
    assert accuracy.implied_mfu(unbounded) > 0.6
    assert (f"bounded by the ~55% MFU that the best published dense 16-bit runs reach, where the device's kernel "
            f"efficiencies alone gave {predicted.unbounded_step_s * 1e3:.3f} ms, {accuracy.implied_mfu(unbounded):.0%} "
            "MFU") in accuracy.describe_prediction(plan)
    # the trace's actions are the kernels' times, which add up to less than the step: its title says so
    title = json.loads((autopart.emit(plan, tmp_path / "out") / "trace.json").read_text())["otherData"]["title"]
    assert title.endswith(f"(the kernels' times; the ~55% MFU ceiling puts the step at {predicted.step_s * 1e3:.3f} ms)")
    assert autopart.compile(wide, dtype="fp32", **options).predicted.unbounded_step_s is None
    small = autopart.compile(wide, dtype="bf16", **{**options, "microbatches": 1, "global_batch_size": 1})
    assert small.predicted.unbounded_step_s is None and "MFU" not in accuracy.describe_prediction(small)


def test_a_plan_for_an_accelerator_prints_its_mfu_and_one_for_the_cpu_does_not(tmp_path, capsys) -> None:
    """The compile line, explain's and report.md give a 16-bit GPU plan's MFU, the figure users hold
    their Megatron and torchtitan runs to; it is the step's own (`implied_mfu`), under the ceiling.
    None for the CPU (its peak is a matrix product measured here), under any name, nor for fp32."""
    wide = Path(__file__).resolve().parent / "models" / "wide_linears.py"
    common = ["--pp", "1", "--microbatches", "4", "--global-batch-size", "4", "--dtype", "bf16"]  # under the ceiling
    main(["compile", str(wide), "-o", str(tmp_path / "gpu"), "--device", "a100-80gb", *common])
    main(["explain", str(tmp_path / "gpu")])
    plan = load_plan(tmp_path / "gpu" / "plan.json")
    mfu = accuracy.implied_mfu(plan)
    assert 0.05 < mfu < accuracy.MFU_CEILING and plan.predicted.unbounded_step_s is None
    printed = " ".join(capsys.readouterr().out.split())
    assert printed.count("ms (a100-80gb roofline") == 2 and printed.count(f", MFU {mfu:.1%}, bubble") == 2
    assert f", MFU {mfu:.1%}, bubble" in (tmp_path / "gpu" / "report.md").read_text()
    assert plan.provenance.device_kind == "cuda"
    xeon = tmp_path / "xeon.toml"  # a CPU spec of the user's, under a name of theirs
    xeon.write_text((Path(cost_models.__file__).parent / "devices" / "cpu.toml").read_text())
    others = {"cpu": ["--device", "cpu"], "xeon": ["--device", str(xeon)],
              "fp32": ["--device", "a100-80gb", "--dtype", "fp32"]}  # its peak is not the one MFU figures are of
    for name, extra in others.items():
        main(["compile", str(MODEL), "-o", str(tmp_path / name), "--pp", "1", "--microbatches", "2", "--no-measure",
              *extra])
        assert "MFU" not in capsys.readouterr().out and "MFU" not in (tmp_path / name / "report.md").read_text(), name


def test_a_broken_accuracy_file_is_one_line(tmp_path) -> None:
    broken = tmp_path / "accuracy.json"
    broken.write_text("{not json")
    with pytest.raises(autopart.AutopartError, match="rerun the benchmark"):
        load_bands(broken)


def test_the_shipped_cpu_bands_hold_for_the_precision_their_rows_ran_in() -> None:
    """cost_accuracy's rows compile and run fp32: a bf16-autocast compile on this CPU printed their
    band ('cost_accuracy: median 4%, worst 13%') as its own, which no benchmark measured."""
    for key in ("cpu-measured", "cpu-measured-pipeline"):
        band = load_bands()[key]
        assert band.holds_for("cpu", "fp32") and not band.holds_for("cpu", "bf16-autocast"), key


def test_a_cost_file_of_another_device_is_not_the_basis_of_a_named_device_s_step(tmp_path) -> None:
    """A100 compiled with --costs of this CPU's ops printed 'ops from c.json', where every op was
    the A100 roofline's: a named device's ops are never timed into the file, and it held none."""
    from cost_models.database import OpTimes

    costs = tmp_path / "c.json"
    database = CostDatabase(path=costs)
    database.put("cpu", "add(float32[1,16]:g)", OpTimes(forward_s=1e-5))
    database.save()
    plan = autopart.compile(MODEL, pp=2, microbatches=2, device="a100-80gb", costs=costs)
    assert plan.predicted.basis == "a100-80gb roofline" and plan.predicted.basis_key == "spec-roofline"
    plan = autopart.compile(MODEL, pp=2, microbatches=2, device="cpu", costs=costs)  # timed into it here
    assert plan.predicted.basis.startswith("ops from c.json")
