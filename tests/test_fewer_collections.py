"""A compile runs with CPython's cycle collector rarer (`autopart.driver.fewer_collections`) and
hands the caller's thresholds back, also when it fails."""

import gc
from pathlib import Path

import pytest

from autopart import driver
from autopart.driver import fewer_collections
from autopart.ir.errors import ConfigError
from autopart.options import CompileOptions
from tests.distributed import REPO


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_collections_are_rarer_inside_and_the_callers_thresholds_come_back(thresholds):
    gc.set_threshold(700, 10, 10)
    with fewer_collections():
        assert gc.get_threshold() == (100_000, 50, 100)
    assert gc.get_threshold() == (700, 10, 10)
    gc.set_threshold(500_000, 5, 1000)  # a caller's rarer thresholds are kept where they are rarer
    with fewer_collections():
        assert gc.get_threshold() == (500_000, 50, 1000)
    gc.set_threshold(0)  # a collector turned off stays off
    with fewer_collections():
        assert gc.get_threshold()[0] == 0
    assert gc.get_threshold()[0] == 0


@pytest.mark.parametrize("entry", ["compile", "compile_to_directory"])
def test_a_compile_runs_inside_and_a_failing_one_restores_them(thresholds, monkeypatch, tmp_path, entry):
    gc.set_threshold(700, 10, 10)
    seen = []

    def failing(options, progress=None):
        seen.append(gc.get_threshold())
        raise ConfigError("stop here")

    monkeypatch.setattr(driver, "measure_defaults", lambda options, **_: (options, None))
    monkeypatch.setattr(driver, "compile_plan", failing)
    model = REPO / "examples" / "gpt.py"
    with pytest.raises(ConfigError, match="stop here"):
        if entry == "compile":
            driver.compile(model, pp=1)
        else:
            driver.compile_to_directory(CompileOptions(model=Path(model), pp=1), tmp_path / "out")
    assert seen == [(100_000, 50, 100)]
    assert gc.get_threshold() == (700, 10, 10)
