"""The default compile measures this machine once per model, a named device never (what each
printed step then rests on, and its band: tests/test_printed_basis.py).

The message profile is replaced by a counter that writes a small profile where the real one
caches it (the real one takes seconds of two processes: tests/test_cost_comm_profile.py runs it);
the op profile is the real one, into a fresh cache directory.
"""

import contextlib
import io
import json
import logging
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

import autopart
from autopart.profiling import measure_defaults
from autopart.tools.cli import main
from autopart.driver import CompileOptions, compile_to_directory
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
