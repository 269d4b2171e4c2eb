"""A compile runs with CPython's cycle collector off (`autopart.driver.cycle_collector_off`) and
hands it back as the caller had it, also when it fails."""

import gc
from pathlib import Path

import pytest

from autopart import driver
from autopart.driver import cycle_collector_off
from autopart.ir.errors import ConfigError
from autopart.options import CompileOptions
from tests.distributed import REPO


@pytest.fixture
def collector():
    was_on = gc.isenabled()
    yield
    if was_on:
        gc.enable()
    else:
        gc.disable()


def test_off_inside_and_as_the_caller_had_it_after(collector):
    gc.enable()
    with cycle_collector_off():
        assert not gc.isenabled()
        with cycle_collector_off():  # a compile inside a compile leaves it off for the outer one
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # a collector the caller turned off stays off
    with cycle_collector_off():
        assert not gc.isenabled()
    assert not gc.isenabled()


@pytest.mark.parametrize("entry", ["compile", "compile_to_directory"])
def test_a_compile_runs_inside_and_a_failing_one_turns_it_back_on(collector, monkeypatch, tmp_path, entry):
    gc.enable()
    seen = []

    def failing(options, progress=None):
        seen.append(gc.isenabled())
        raise ConfigError("stop here")

    monkeypatch.setattr(driver, "measure_defaults", lambda options, **_: (options, None))
    monkeypatch.setattr(driver, "compile_plan", failing)
    model = REPO / "examples" / "gpt.py"
    with pytest.raises(ConfigError, match="stop here"):
        if entry == "compile":
            driver.compile(model, pp=1)
        else:
            driver.compile_to_directory(CompileOptions(model=Path(model), pp=1), tmp_path / "out")
    assert seen == [False]
    assert gc.isenabled()
