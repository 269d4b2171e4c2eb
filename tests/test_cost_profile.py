"""The profiler and its cost database: reuse, the command line, and predictions that follow it."""

import json
import re
from pathlib import Path

import pytest

from autopart.driver import compile
from autopart.ir.errors import ConfigError
from cost_models import CostDatabase, ProfiledCostModel, known_devices
from tests.distributed import REPO, run_cli_here

MODEL = (REPO / "tests" / "models" / "three_layers.py").read_text()


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "three_layers.py"
    path.write_text(MODEL)
    return path


@pytest.fixture
def timings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every op the profiler times, by key, in order."""
    timed: list[str] = []
    real_put = CostDatabase.put

    def put(self, device, op_key, times):
        if not op_key.startswith("optimizer."):
            timed.append(op_key)
        real_put(self, device, op_key, times)

    monkeypatch.setattr(CostDatabase, "put", put)
    return timed


def test_second_compile_times_nothing_and_repeated_layers_are_timed_once(model_file: Path, tmp_path: Path,
                                                                           timings: list[str]) -> None:
    costs = tmp_path / "costs.json"
    first = compile(model_file, pp=2, microbatches=2, costs=costs, time_limit_s=5)
    assert timings and len(timings) == len(set(timings))
    linears = [k for k in timings if k.startswith("linear(float32[4,16]:g, float32[16,16]:w")]
    assert len(linears) == 1  # three identical layers, one measurement
    saved = costs.read_text()
    timings.clear()
    second = compile(model_file, pp=2, microbatches=2, costs=costs, time_limit_s=5)
    assert timings == []
    assert costs.read_text() == saved
    assert second.predicted.stage_time_s == first.predicted.stage_time_s
    assert first.provenance.cost_model == "profiled:cpu"


def test_costs_change_predictions_through_the_cost_model(model_file: Path, tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    measured = compile(model_file, pp=1, microbatches=2, costs=costs, time_limit_s=5)
    roofline = compile(model_file, pp=1, microbatches=2, time_limit_s=5)
    assert measured.stages[0].forward_s != roofline.stages[0].forward_s
    database = json.loads(costs.read_text())
    for times in database["entries"].values():
        times["forward_s"] *= 10
    slower = tmp_path / "slower.json"
    slower.write_text(json.dumps(database))
    scaled = compile(model_file, pp=1, microbatches=2, costs=slower, time_limit_s=5)
    assert scaled.stages[0].forward_s == pytest.approx(10 * measured.stages[0].forward_s, rel=1e-9)
    assert scaled.predicted.step_s > measured.predicted.step_s
    # measurements of this CPU say nothing about another device: it keeps its roofline
    h100 = compile(model_file, pp=1, microbatches=2, device="h100-sxm", costs=slower, time_limit_s=5)
    plain = compile(model_file, pp=1, microbatches=2, device="h100-sxm", time_limit_s=5)
    assert h100.stages[0].forward_s == plain.stages[0].forward_s


def test_profile_cli_writes_a_valid_database(model_file: Path, tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    result = run_cli_here("profile", str(model_file), "-o", str(costs), "--micro-batch-size", "1", "2")
    assert result.returncode == 0, result.stderr
    assert re.search(r"timed \d+ ops \(0 already in the database\)", result.stdout)
    database = CostDatabase.load(costs, missing_ok=False)
    assert database.overheads["cpu"].autograd_call_s > 0
    assert all(key.startswith("cpu|torch ") for key in database.entries)
    assert any("float32[2,16]" in key for key in database.entries)  # both microbatch sizes
    assert any(key.split("|")[2].startswith("optimizer.adamw(") for key in database.entries)
    for times in database.entries.values():
        assert times.forward_s >= 0 and times.backward_input_s >= 0 and times.backward_weight_s >= 0
    again = run_cli_here("profile", str(model_file), "-o", str(costs))
    assert "timed 0 ops" in again.stdout


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], r"can only profile on cpu or cuda, got --device 'tpu'"),
    (["--optimizer", "lion"], r"unknown optimizer 'lion'"),
])
def test_profile_cli_errors_are_one_line(model_file: Path, tmp_path: Path, args: list[str], message: str) -> None:
    result = run_cli_here("profile", str(model_file), "-o", str(tmp_path / "c.json"), *args)
    assert result.returncode == 2
    assert re.fullmatch(rf"autopart: error: {message}.*\n", result.stderr)


def test_the_solver_never_names_a_device() -> None:
    names = {*known_devices(), "cuda", "nvidia", "a100", "h100", "h200", "mi300"}
    for source in (REPO / "autopart" / "solve").rglob("*.py"):
        text = source.read_text().lower()
        for name in names:
            assert name not in text, f"{source.name} names the device {name!r}: costs must come through the CostModel"


# bf16 on the CPU: a model whose fp32 input meets a bf16 layer-norm weight cannot run there (CPU
# autocast runs layer_norm in the input's dtype), so bf16 is profiled on a model without norms
@pytest.mark.parametrize("dtype, model", [("fp32", None), ("bf16-autocast", None), ("bf16", "tanh_mlp.py")])
def test_profiled_keys_are_the_keys_a_compile_of_that_precision_looks_up(
    model_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, timings: list[str], dtype: str, model: str | None
) -> None:
    model_file = REPO / "tests" / "models" / model if model else model_file
    costs = tmp_path / "costs.json"
    result = run_cli_here("profile", str(model_file), "-o", str(costs), "--micro-batch-size", "2", "--dtype", dtype)
    assert result.returncode == 0, result.stderr
    profiled = CostDatabase.load(costs, missing_ok=False).entries
    assert all(("autocast=bf16" in key) == (dtype != "fp32") for key in profiled if "optimizer." not in key)
    timings.clear()  # what the profile timed, in this process
    looked_up: list[tuple[str, bool]] = []
    real_op_times = ProfiledCostModel.op_times

    def op_times(self, op_key, *kernels):
        looked_up.append((op_key, self.database.get(self.device.name, op_key) is not None))
        return real_op_times(self, op_key, *kernels)

    monkeypatch.setattr(ProfiledCostModel, "op_times", op_times)
    compile(model_file, pp=1, microbatches=2, micro_batch_size=2, costs=costs, dtype=dtype, time_limit_s=5)
    assert timings == [], "the compile found every op measured, so it timed none again"
    assert looked_up and [key for key, found in looked_up if not found] == [], "no op fell back to the roofline"


@pytest.mark.parametrize("figure", ["Infinity", "NaN", "-1.0", "1e300"])
def test_a_cost_database_of_figures_no_measurement_gives_is_refused_in_one_line(tmp_path: Path, figure: str) -> None:
    """An infinite op time kept the search from ever finishing; NaN, negative and absurd ones were
    carried into the predicted step: the file is refused where it is read, saying why."""
    costs = tmp_path / "costs.json"
    entry = {"forward_s": 1e-4, "backward_input_s": 1e-4, "backward_weight_s": 1e-4}
    costs.write_text('{"schema": 2, "entries": {"cpu|torch 2|add(float32[1,16]:g)": '
                     + json.dumps(entry).replace("0.0001}", figure + "}") + "}}")
    with pytest.raises(ConfigError, match=r"costs\.json is not a valid cost database \(\S+ is not a (measured figure|time "
                                          r"in seconds).*\); give one that 'autopart profile' wrote"):
        CostDatabase.load(costs)
    costs.write_text(costs.read_text().replace(figure, "0.0001"))
    assert CostDatabase.load(costs).entries  # the same file with a measured figure reads back


def test_a_cost_database_s_hosts_are_a_list_of_names(tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    costs.write_text('{"schema": 2, "entries": {}, "hosts": {"cpu": "gpu-node-7"}}')
    with pytest.raises(ConfigError, match=r"hosts 'gpu-node-7' are not a list of host names"):
        CostDatabase.load(costs)
    costs.write_text('{"schema": 2, "entries": {}, "hosts": {"cpu": ["gpu-node-7"]}}')
    assert CostDatabase.load(costs).measured_on() == ["gpu-node-7"]


@pytest.mark.parametrize("load", ["-5", "NaN"])
def test_a_pipeline_measured_beside_a_load_no_count_gives_is_refused(tmp_path: Path, load: str) -> None:
    """A negative count added to the busy processes a prediction counts; NaN was read as it was."""
    costs = tmp_path / "costs.json"
    costs.write_text('{"schema": 2, "entries": {}, "pipelines": {"plan": {"compute_factor": 1.0, "background_load": '
                     + load + "}}}")
    with pytest.raises(ConfigError, match=r"costs\.json is not a valid cost database \(\S+ is not a (count of busy "
                                          r"processes|measured figure)"):
        CostDatabase.load(costs)
    costs.write_text(costs.read_text().replace(load, "2"))
    assert CostDatabase.load(costs).pipelines["plan"].background_load == 2.0
