"""``AUTOPART_MEASURE_SECONDS`` caps how long every measuring loop runs; the loops' counts of
runs stay. Each test counts runs, not seconds: with the cap at 0 a loop runs exactly its count,
where its own span (seconds) would run a small model hundreds of times."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import fx, nn

from autopart.ir.errors import ConfigError
from autopart.profiling import pipeline
from autopart.profiling.co_run import measure_co_run
from autopart.profiling.in_situ import REPEATS, optimizer_in_situ, time_in_situ
from autopart.profiling.span import MEASURE_SECONDS_ENV, span
from tests.distributed import REPO, run_cli_here


def test_the_cap_lowers_a_span_and_never_raises_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MEASURE_SECONDS_ENV, raising=False)
    assert span(5.0) == 5.0
    monkeypatch.setenv(MEASURE_SECONDS_ENV, "0.25")
    assert span(5.0) == 0.25 and span(0.1) == 0.1
    monkeypatch.setenv(MEASURE_SECONDS_ENV, " ")
    assert span(5.0) == 5.0


@pytest.mark.parametrize("text", ["abc", "-1", "nan"])
def test_a_cap_that_is_not_seconds_is_refused(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(MEASURE_SECONDS_ENV, text)
    with pytest.raises(ConfigError, match=rf"AUTOPART_MEASURE_SECONDS='{text}' is not a number of seconds"):
        span(1.0)


def test_the_command_line_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(MEASURE_SECONDS_ENV, "soon")
    result = run_cli_here("profile", str(REPO / "tests" / "models" / "three_layers.py"), "-o", str(tmp_path / "c.json"))
    assert result.returncode == 2
    assert result.stderr.startswith("autopart: error: AUTOPART_MEASURE_SECONDS='soon' is not a number of seconds")
    assert result.stderr.count("\n") == 1 and not (tmp_path / "c.json").exists()


def test_ops_in_place_run_their_count_under_a_cap_of_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
    forwards = []
    module.get_submodule("0").register_forward_hook(lambda *_: forwards.append(1))
    x = torch.randn(4, 8)
    time_in_situ(module, [x], min_seconds=0.0)
    counted = len(forwards)
    forwards.clear()
    monkeypatch.setenv(MEASURE_SECONDS_ENV, "0")
    time_in_situ(module, [x])  # by default, 5 seconds of runs
    assert len(forwards) == counted >= REPEATS


def test_the_optimizer_runs_its_count_under_a_cap_of_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
    steps = []

    def make_step(parameters):
        return lambda: steps.append(1)

    monkeypatch.setenv(MEASURE_SECONDS_ENV, "0")
    optimizer_in_situ(module, [torch.randn(4, 8)], make_step, repeats=5)
    assert len(steps) == 1 + 5  # the state's step, then the timed ones


def test_copies_computing_at_once_run_their_rounds_under_a_cap_of_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fx.symbolic_trace(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)))
    monkeypatch.setenv(MEASURE_SECONDS_ENV, "0")
    measured = measure_co_run(module, [torch.randn(16, 32)], processes=2, rounds=3)
    assert measured.rounds == 3


class _Launched(Exception):
    pass


@pytest.mark.parametrize("cap, seconds", [("0", "0.0"), ("0.5", "0.5"), ("", "8.0")])
def test_a_plan_s_run_lasts_the_capped_seconds_within_its_least_and_most_steps(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cap: str, seconds: str) -> None:
    launched = []

    def run_locally(out_dir, world_size, args, **kwargs):
        launched.append(args)
        raise _Launched

    monkeypatch.setattr(pipeline, "run_locally", run_locally)
    monkeypatch.setenv(MEASURE_SECONDS_ENV, cap)
    plan = SimpleNamespace(predicted=SimpleNamespace(step_s=0.001), world_size=2)
    with pytest.raises(_Launched):
        pipeline.profile_pipeline(tmp_path, plan, overheads=None, cores=2)
    warmup = pipeline.WARMUP_STEPS
    assert launched[0][:8] == ["--steps", str(warmup + pipeline.MAX_STEPS), "--min-steps",
                               str(warmup + pipeline.MEASURED_STEPS), "--untimed-steps", str(warmup), "--seconds", seconds]


def test_a_finalist_s_run_lasts_its_seconds_past_its_warm_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from autopart.profiling import finalists

    launched = []

    def run_locally(out_dir, world_size, args, **kwargs):
        launched.append(args)
        raise _Launched

    monkeypatch.setattr(finalists, "run_locally", run_locally)
    monkeypatch.setattr(finalists, "emit_directory", lambda *args, **kwargs: tmp_path)
    monkeypatch.delenv(MEASURE_SECONDS_ENV, raising=False)
    plan = SimpleNamespace(predicted=SimpleNamespace(step_s=0.001), world_size=2,
                           provenance=SimpleNamespace(cost_model="roofline:cpu"))
    front = SimpleNamespace(op_graph=None, spec=None, chain=None)
    with pytest.raises(_Launched):
        finalists.finalist_step_s(SimpleNamespace(plan=plan, front=front))
    warmup = finalists.WARMUP_STEPS
    assert launched[0][:8] == ["--steps", str(warmup + finalists.MAX_STEPS), "--min-steps",
                               str(warmup + finalists.MEASURED_STEPS), "--untimed-steps", str(warmup),
                               "--seconds", repr(finalists.MEASURED_SECONDS)]
