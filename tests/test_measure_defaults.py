"""The default compile measures this machine once per model, a named device never, and every
predicted step carries its basis and the band that the shipped accuracy file records.

The message profile is replaced by a counter that writes a small profile where the real one
caches it (the real one takes seconds of two processes: tests/test_cost_comm_profile.py runs it);
the op profile is the real one, into a fresh cache directory.
"""

import contextlib
import io
import json
import logging
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

import autopart
import cost_models
from autopart.predict import accuracy
from autopart.profiling import measure_defaults
from autopart.predict.accuracy import Band, basis_for, load_bands, write_band
from autopart.tools.cli import main
from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.plan import load_plan
from autopart.profiling.co_run import co_run_key, host_processes
from cost_models.calibration import usable_cores
from cost_models.comm_profile import CommProfile, cache_path, load_comm_profile
from cost_models.database import CoRunMeasurement, CostDatabase
from cost_models.devices import local_device_name

MODEL = Path(__file__).parent / "models" / "three_layers.py"


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory, and a message profile that counts its runs instead of timing."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(cache))
    monkeypatch.delenv(measure_defaults.NO_MEASURE_ENV, raising=False)  # the suite's conftest turns it off
    calls = []

    def fake_profile_comm(*, ranks, backend, effort):
        calls.append(effort)
        profile = CommProfile(device="cpu", backend=backend, ranks=ranks, host="test", torch_version=torch.__version__,
                              curves={"p2p": [[4, 1e-4], [1 << 20, 1e-3]]}, process_bytes=300 << 20)
        path = cache_path("cpu", backend)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(profile)))
        return profile, path

    monkeypatch.setattr(measure_defaults, "profile_comm", fake_profile_comm)
    return cache, calls


def _bands_file(path: Path, median: float, worst: float) -> Path:
    band = Band(median=median, worst=worst, rows=6, benchmark="cost_accuracy", command="python x.py", date="2026-12-01")
    write_band("cpu-measured", band, path)
    write_band("spec-roofline", Band(**{**asdict(band), "benchmark": "published_runs"}), path)
    return path


@pytest.mark.multiprocess
def test_the_default_compile_measures_once_and_a_second_reads_the_cache(fresh_cache) -> None:
    cache, calls = fresh_cache
    options = CompileOptions(model=MODEL, pp=2, microbatches=2)
    console = Console(file=io.StringIO())
    statuses, status = [], console.status
    console.status = lambda what, **kwargs: (statuses.append(what), status(what, **kwargs))[1]
    measured_options, first = measure_defaults.measure_defaults(options, console=console)
    database = measured_options.costs
    assert database.parent == cache / "costs" and database.exists()
    assert first.ops_timed > 0 and first.messages_measured and len(calls) == 1
    assert calls[0] == measure_defaults.QUICK and load_comm_profile("cpu") is not None
    # no stretch of the measuring goes unannounced: the ops in place, the messages; not the ranks beside
    # each other, which the pipeline's run (below) measures inside the pipeline instead
    assert statuses == ["timing every op in place, in the whole forward and backward (seconds)",
                        "measuring messages between two processes on this machine (once)"]
    written = database.stat().st_mtime_ns, database.read_bytes()

    _, second = measure_defaults.measure_defaults(options)
    assert second.ops_timed == 0 and not second.messages_measured and len(calls) == 1
    assert (database.stat().st_mtime_ns, database.read_bytes()) == written
    processes = host_processes(2, usable_cores())  # the plan's two ranks on this host, one per core at most
    at_once = _at_once()
    # a layout given in full on this CPU: the compile runs its pipeline here too (below)
    assert second.basis.what == "ops, this pipeline and messages measured on this machine"
    assert second.without_pipeline.what == f"ops{at_once} and messages measured on this machine"
    assert CostDatabase.load(database).co_run(local_device_name("cpu"), co_run_key("fp32", processes)) is None

    before = CostDatabase.load(database)
    plan = autopart.compile(MODEL, pp=2, microbatches=2)  # the same cache: no op timed, the pipeline run once
    assert plan.predicted.basis == "ops, this pipeline and messages measured on this machine" and len(calls) == 1
    assert plan.predicted.basis_key == "cpu-measured-pipeline"  # its own band: cost_accuracy --default writes it
    assert plan.predicted.compute_factor_from == "pipeline" and plan.predicted.profiled_step_s > 0
    after, ran = CostDatabase.load(database), database.read_bytes()
    assert after.entries == before.entries and len(after.pipelines) == len(before.pipelines) + 1
    again = autopart.compile(MODEL, pp=2, microbatches=2)  # found in the cache: nothing runs
    assert database.read_bytes() == ran and again.predicted.profiled_step_s == plan.predicted.profiled_step_s


@pytest.mark.parametrize("why", ["too_long", "failed"])
def test_a_pipeline_run_not_made_after_all_leaves_the_model_timed_beside_its_copies(fresh_cache, monkeypatch, why):
    """The default compile of a layout given in full skips the co-run, which its pipeline run
    replaces; where that run is not made (its steps too long, or it failed), it measures the
    co-run then, and the plan's compute rests on it, as the basis says."""
    if host_processes(2, usable_cores()) < 2:
        pytest.skip("one core: the ranks take turns, and nothing is timed beside a copy")
    import autopart.driver as driver

    if why == "too_long":
        monkeypatch.setattr(driver, "affordable", lambda plan: False)
    else:
        def fails(*args, **kwargs):
            raise driver.LocalRunError("a rank failed")
        monkeypatch.setattr(driver, "profiled_in_place", fails)
    console = Console(file=io.StringIO())
    statuses, status = [], console.status
    console.status = lambda what, **kwargs: (statuses.append(what), status(what, **kwargs))[1]
    plan, _ = driver.measured_plan(CompileOptions(model=MODEL, pp=2, microbatches=2), console=console)
    assert plan.predicted.compute_factor_from == "co-run"
    assert statuses[-1] == "timing the model beside the host's other ranks (the pipeline's run was not made)"
    assert plan.predicted.basis == f"ops{_at_once()} and messages measured on this machine"
    database = CostDatabase.load(measure_defaults.costs_cache_path(MODEL, "cpu"))
    co_run = database.co_run(local_device_name("cpu"), co_run_key("fp32", 2))
    micro_batch_size = CompileOptions(model=MODEL, pp=2, microbatches=2).batch_shape()[2]
    assert co_run is not None and co_run.processes == 2 and co_run.rounds > 0
    assert co_run.micro_batch_size == micro_batch_size


def test_a_run_not_made_on_a_host_of_one_core_leaves_the_plan_as_compiled(fresh_cache, monkeypatch, caplog):
    """Where the plan's ranks compute alone here (one core: they take turns), there is no co-run
    the skipped run left untimed, so the plan is not compiled again."""
    import autopart.driver as driver

    compiles = []
    compile_plan = driver.compile_plan
    monkeypatch.setattr(driver, "compile_plan", lambda *args: compiles.append(args) or compile_plan(*args))
    monkeypatch.setattr(driver, "affordable", lambda plan: False)
    monkeypatch.setattr(driver, "usable_cores", lambda: 1)
    monkeypatch.setattr(measure_defaults, "usable_cores", lambda: 1)
    with caplog.at_level(logging.INFO, logger="autopart"):
        plan, _ = driver.measured_plan(CompileOptions(model=MODEL, pp=2, microbatches=2))
    assert "too long" in caplog.text  # the run the default compile meant to make, not made
    assert len(compiles) == 1 and plan.predicted.compute_factor_from != "co-run"


@pytest.mark.parametrize("pp, runs_pipeline", [(2, True), (8, False)])
def test_the_ops_in_place_span_only_what_their_shares_need_where_the_pipeline_runs_next(
        fresh_cache, monkeypatch, pp, runs_pipeline):
    """A layout run here next (pp 2) has its ops timed in place for `SHARES_SECONDS`: the run
    sets each stage's level. One not run (pp 8: more than two ranks per core here) for
    `MIN_SECONDS`, the level its prediction rests on."""
    from autopart.profiling import in_situ, profile

    spans = []

    def time_in_situ(*args, min_seconds=None, **kwargs):
        spans.append(min_seconds)
        return in_situ.time_in_situ(*args, min_seconds=0.0, **kwargs)  # the count of runs, not the seconds

    monkeypatch.setattr(profile, "time_in_situ", time_in_situ)
    monkeypatch.setattr(profile, "measure_co_run", lambda *args, processes, **kwargs:  # pp 8's: not what is tested
                        CoRunMeasurement(processes=processes, factor=1.0, rounds=1))
    monkeypatch.setattr(measure_defaults, "usable_cores", lambda: 2)
    monkeypatch.delenv("AUTOPART_MEASURE_SECONDS", raising=False)  # the suite's cap: the spans as they are
    options, _ = measure_defaults.measure_defaults(CompileOptions(model=MODEL, pp=pp, microbatches=pp))
    assert options.profile_pipeline == runs_pipeline
    assert spans == [in_situ.SHARES_SECONDS if runs_pipeline else None]  # None: time_in_situ's MIN_SECONDS


def _at_once() -> str:
    """How the basis says two ranks' ops were timed on this machine."""
    if host_processes(2, usable_cores()) == 2:
        return " (timed 2 at once, as the plan's ranks on this host compute)"
    return (" (timed 1 at once, one per core; the plan's 2 ranks on this host take turns on its 1 core, as the step "
            "counts them)")  # a machine of one core


def test_a_search_s_first_compile_sees_the_co_run_figure_it_measures(fresh_cache) -> None:
    """The search captures each micro-batch size with options of one rank; the model's slowdown
    beside the host's other ranks is measured for the search's ranks with the first capture's
    ops, so the plan of the first compile reads it, as the second does (its compute the same)."""
    if host_processes(2, usable_cores()) < 2:
        pytest.skip("one core: no co-run to measure")
    options = dict(world_size=2, global_batch_size=8, pp=1, tp=1, schedule="1f1b", recompute="none",
                   microbatches=2, dtype="fp32", run_finalists=False)
    first = autopart.compile(MODEL, **options)
    assert first.predicted.compute_factor_from == "co-run"
    again = autopart.compile(MODEL, **options)
    assert again.predicted.compute_factor_from == "co-run"
    assert again.predicted.compute_factor == first.predicted.compute_factor
    assert again.predicted.stage_time_s == first.predicted.stage_time_s
    # the step also counts the other processes busy on the cores at each compile, which the suite
    # does not control: equal where the two compiles saw the same load
    if again.predicted.background_load == first.predicted.background_load:
        assert again.predicted.step_s == first.predicted.step_s


class _Console:
    """A console that counts the live displays opened on it."""

    def __init__(self):
        self.statuses = []

    def status(self, what):
        self.statuses.append(what)
        return contextlib.nullcontext()


def test_a_search_s_bar_hears_the_measuring_and_no_second_display_opens(fresh_cache) -> None:
    """On a search the CLI's progress bar is live already; a status of the console's own beside
    it would overwrite its lines, so the measuring is said on the bar. Without the bar, on the
    console; measured once, neither hears of it again."""
    _, calls = fresh_cache
    options = CompileOptions(model=MODEL, world_size=2, global_batch_size=8)
    console, heard = _Console(), []
    measure_defaults.measure_defaults(options, console=console, progress=lambda *a: heard.append(a))
    assert heard == [("measuring messages between two processes on this machine (once)", 0, 0)]
    assert console.statuses == [] and len(calls) == 1

    Path(cache_path("cpu", "gloo")).unlink()  # measured again: now with no bar
    measure_defaults.measure_defaults(options, console=console)
    assert console.statuses == ["measuring messages between two processes on this machine (once)"]
    measure_defaults.measure_defaults(options, console=console, progress=lambda *a: heard.append(a))
    assert len(heard) == 1 and len(console.statuses) == 1 and len(calls) == 2


def test_the_compile_hands_the_search_s_bar_to_the_measuring(fresh_cache, tmp_path, monkeypatch) -> None:
    """`compile_to_directory` passes its ``progress`` on: the measuring speaks on the search's bar."""
    from autopart import driver

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(driver, "compile_plan", stop)  # what follows the measuring is not this test's
    heard = []
    with pytest.raises(Stop):
        compile_to_directory(CompileOptions(model=MODEL, world_size=2, global_batch_size=8), tmp_path / "out",
                             progress=lambda *a: heard.append(a[0]), console=_Console())
    assert heard == ["measuring messages between two processes on this machine (once)"]


def test_a_named_device_and_no_measure_measure_nothing(fresh_cache, monkeypatch) -> None:
    cache, calls = fresh_cache

    def refuse(*args, **kwargs):
        raise AssertionError("measured on a path that must not measure")

    monkeypatch.setattr(measure_defaults, "_profile_ops", refuse)
    plan = autopart.compile(MODEL, pp=2, microbatches=2, device="a100-80gb")
    assert plan.predicted.basis == "a100-80gb roofline" and plan.predicted.basis_key == "spec-roofline"
    plan = autopart.compile(MODEL, pp=2, microbatches=2, measure=False)
    assert "nothing measured (--no-measure)" in plan.predicted.basis
    assert not calls and not (cache / "costs").exists()


def test_the_printed_step_carries_the_band_of_the_shipped_file(fresh_cache, tmp_path, monkeypatch, capsys) -> None:
    bands = _bands_file(tmp_path / "accuracy.json", 0.06, 0.12)
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

    _bands_file(bands, 0.09, 0.31)  # the benchmark ran again: the next compile says so
    main(["compile", str(MODEL), "-o", str(out), "--pp", "2", "--microbatches", "2", "--device", "h100-sxm"])
    assert "median 9%, worst 31%" in " ".join(capsys.readouterr().out.split())


def test_a_band_holds_only_on_the_devices_and_precision_its_rows_ran_on(fresh_cache, tmp_path, monkeypatch,
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


def test_a_band_holds_only_for_the_layouts_its_rows_ran(fresh_cache, tmp_path, monkeypatch, capsys) -> None:
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
    assert load_bands()["spec-roofline"].holds_for_layout("tp+dp")  # published runs of every layout


def test_into_a_pipe_a_search_table_keeps_each_row_on_one_line(fresh_cache, tmp_path, capsys) -> None:
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


def test_a_zero3_plan_carries_the_band_of_the_zero3_rows(fresh_cache, tmp_path, monkeypatch, capsys) -> None:
    """A plan that gathers its layers for every forward and backward is off by other amounts than
    the rest: where the benchmark measured its rows apart, a ZeRO-3 plan prints their band."""
    bands = _bands_file(tmp_path / "accuracy.json", 0.06, 0.12)
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
    assert printed.count(f"ms (a100-80gb roofline") == 2 and printed.count(f", MFU {mfu:.1%}, bubble") == 2
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


def test_a_missing_model_file_is_still_one_line_on_the_measuring_path(fresh_cache, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["compile", str(tmp_path / "missing.py"), "-o", str(tmp_path / "out"), "--pp", "2"])
    assert exit_.value.code == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_model_built_on_the_meta_device_is_measured_with_weights_made_as_the_ranks_make_them(fresh_cache,
                                                                                              tmp_path) -> None:
    """The default compile times ops on real tensors: a model on the meta device is made on the CPU
    from its own initialisers first (it crashed on its meta weights), and the capture the rest of
    the compile reads stays on meta, so no weights are written."""
    cache, _ = fresh_cache
    options = CompileOptions(model=MODEL.parent / "meta_lm.py", pp=2, microbatches=2, micro_batch_size=2)
    plan, _ = compile_to_directory(options, tmp_path / "out")
    assert plan.provenance.cost_model.startswith("profiled"), plan.provenance.cost_model
    assert plan.predicted.basis_key == "cpu-measured-pipeline" and list((cache / "costs").glob("*.json"))
    assert not any(load_file(str(p)) for p in (tmp_path / "out" / "weights").glob("*.safetensors"))


def test_a_compile_runs_the_pipeline_here_only_where_the_plan_s_ranks_can_run_here(fresh_cache) -> None:
    """A layout given in full for this CPU, its ranks at most two per core; not a search (it runs
    its finalists), not a named device, not a plan file."""
    cores = usable_cores()

    def runs(**given) -> bool:
        options = CompileOptions(model=MODEL, microbatches=2, **given)
        return measure_defaults.measure_defaults(options)[0].profile_pipeline

    assert runs(pp=2, micro_batch_size=1)
    host = 2 * cores + 2  # the ranks on one host
    assert runs(pp=2, dp=cores, micro_batch_size=1, gpus_per_node=host)  # two ranks per core
    assert not runs(pp=2, dp=cores + 1, micro_batch_size=1, gpus_per_node=host)  # more
    assert not runs(pp=2, dp=2, micro_batch_size=1, gpus_per_node=2)  # over two hosts
    assert not runs(world_size=2, global_batch_size=8)
    assert not runs(pp=2, micro_batch_size=1, device="a100-80gb")


def test_a_pipeline_run_that_fails_by_default_warns_and_one_asked_for_refuses(fresh_cache, monkeypatch, caplog) -> None:
    from autopart.profiling import pipeline
    from autopart.tools.local_run import LocalRunError

    def fail(*args, **kwargs):
        raise LocalRunError("the distributed run failed (exit 1):\nrank 0: out of memory")

    monkeypatch.setattr(pipeline, "run_locally", fail)
    with caplog.at_level(logging.WARNING, logger="autopart"):
        plan = autopart.compile(MODEL, pp=2, microbatches=2)
    assert plan.predicted.basis == f"ops{_at_once()} and messages measured on this machine"
    assert plan.predicted.compute_factor_from != "pipeline"
    assert "running the plan here to measure its pipeline failed (the distributed run failed (exit 1):); the " \
           "predicted step rests on its ops and messages alone" in caplog.text
    costs = measure_defaults.costs_cache_path(MODEL, "cpu")
    with pytest.raises(LocalRunError, match="out of memory"):
        autopart.compile(MODEL, pp=2, microbatches=2, costs=costs, profile_pipeline=True)


def test_a_plan_too_slow_to_run_by_default_is_not_run(fresh_cache, monkeypatch, caplog) -> None:
    """A large model's steps take minutes on a CPU: the default compile runs a pipeline only where
    its shortest run is predicted within `DEFAULT_RUN_SECONDS`."""
    from autopart.profiling import pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("ran a plan too slow to run by default")

    monkeypatch.setattr(pipeline, "run_locally", refuse)
    monkeypatch.setattr(pipeline, "DEFAULT_RUN_SECONDS", 1e-9)
    with caplog.at_level(logging.INFO, logger="autopart"):
        plan = autopart.compile(MODEL, pp=2, microbatches=2)
    assert plan.predicted.basis == f"ops{_at_once()} and messages measured on this machine"
    assert plan.predicted.basis_key == "cpu-measured" and "too long" in caplog.text and "to run here by default" in caplog.text


@pytest.mark.parametrize("content", ['{"schema": 2, "entries": {"cpu|torch', "", '{"schema": 1, "entries": {}}'])
def test_a_cached_database_that_cannot_be_read_is_measured_again(fresh_cache, monkeypatch, caplog, content) -> None:
    """A cache file cut short, emptied or of another schema failed the compile with the error a
    --costs file gets ('give one that autopart profile wrote'), for a file the user never named."""
    cached = measure_defaults.costs_cache_path(MODEL, "cpu")
    cached.parent.mkdir(parents=True)
    cached.write_text(content)
    monkeypatch.setattr(measure_defaults, "_profile_ops", lambda options, kind, path, console: 0)
    with caplog.at_level(logging.INFO, logger="autopart"):
        options, measured = measure_defaults.measure_defaults(CompileOptions(model=MODEL, pp=2, microbatches=2))
    assert options.costs == cached and measured.costs == cached
    assert CostDatabase.load(cached, missing_ok=False).entries == {}  # what the compile reads next
    assert f"the cached cost database {cached} is not one this autopart can read" in caplog.text


@pytest.mark.parametrize("command", ["compile", "profile-comm"])
def test_a_cache_folder_that_is_a_file_is_one_line_before_anything_is_measured(fresh_cache, tmp_path, monkeypatch,
                                                                               capsys, command) -> None:
    """AUTOPART_CACHE_DIR naming a file failed both commands with FileExistsError's traceback, and
    profile-comm only after its seconds of measuring."""
    a_file = tmp_path / "not_a_folder"
    a_file.write_text("mine\n")
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(a_file))
    argv = ["compile", str(MODEL), "-o", str(tmp_path / "out"), "--pp", "2"] if command == "compile" else [command]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"autopart: error: AUTOPART_CACHE_DIR {a_file} cannot hold autopart's measurements "
                                       "(it is a file); set AUTOPART_CACHE_DIR to a folder you may write, or compile "
                                       "with --no-measure, which measures nothing\n")
    assert a_file.read_text() == "mine\n" and not (tmp_path / "out").exists()


def test_costs_measured_on_another_host_are_named_so_in_the_basis(tmp_path) -> None:
    """A cost file copied from another machine's CPU read as this machine's ('ops from c.json'):
    its keys name the device, not the host. The database now records its hosts, and the basis
    names them where one is not this machine."""
    import socket

    from cost_models.database import OpTimes

    costs = tmp_path / "c.json"
    database = CostDatabase(path=costs)
    database.put("cpu", "add(float32[1,16]:g)", OpTimes(forward_s=1e-5))
    database.save()
    assert CostDatabase.load(costs).measured_on() == [socket.gethostname()]
    options = CompileOptions(model=MODEL, pp=2, microbatches=2, costs=costs)
    _, measured = measure_defaults.measure_defaults(options)
    assert measured.basis.what.startswith("ops from c.json, messages")  # measured here: nothing to add
    data = json.loads(costs.read_text())
    costs.write_text(json.dumps({**data, "hosts": {"cpu": ["gpu-node-7"]}}))
    _, measured = measure_defaults.measure_defaults(options)
    assert measured.basis.what.startswith("ops from c.json, measured on gpu-node-7, messages"), measured.basis.what


def test_the_shipped_cpu_bands_hold_for_the_precision_their_rows_ran_in() -> None:
    """cost_accuracy's rows compile and run fp32: a bf16-autocast compile on this CPU printed their
    band ('cost_accuracy: median 4%, worst 13%') as its own, which no benchmark measured."""
    for key in ("cpu-measured", "cpu-measured-pipeline"):
        band = load_bands()[key]
        assert band.holds_for("cpu", "fp32") and not band.holds_for("cpu", "bf16-autocast"), key


def test_an_edit_beside_the_model_file_is_cached_apart(tmp_path, monkeypatch) -> None:
    """The cached database (and the co-run factor in it) was kept by the model file's hash alone:
    layers.py beside it, edited, read the figures of the model before the edit."""
    from tests.tiny_models import beside_model

    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path / "cache"))
    model = beside_model(tmp_path)
    before = measure_defaults.costs_cache_path(model, "cpu")
    assert measure_defaults.costs_cache_path(model, "cpu") == before
    (tmp_path / "layers.py").write_text((tmp_path / "layers.py").read_text().replace("(8, 8)", "(8, 8, bias=False)"))
    assert measure_defaults.costs_cache_path(model, "cpu") != before


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
