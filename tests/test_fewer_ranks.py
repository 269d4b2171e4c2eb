"""A search whose ranks outnumber this CPU's cores records, and the command line says, when one
rank per core is predicted to train faster than its plan ran."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autopart.driver import CompileOptions, compile_plan, with_fewer_ranks
from autopart.ir.plan import load_plan
from autopart.tools.cli import main as cli_main
from autopart.predict.accuracy import Band, Basis

TINY_GPT = Path(__file__).parent / "models" / "tiny_gpt.py"
BAND = Band(median=0.1, worst=0.2, rows=8, benchmark="cost_accuracy", command="", date="")
BASIS = Basis(key="cpu-measured", what="ops and messages measured on this machine", band=BAND)


@pytest.fixture(scope="module", autouse=True)
def quiet_machine():
    """No busy process beside the compile: each compile's predicted step charges the load it
    samples, and the tests compare the step of one search of world size 2 with another's."""
    from cost_models import calibration

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibration, "background_load", lambda cores, seconds=0.3: 0.0)
        yield


@pytest.fixture(scope="module")
def searched(quiet_machine):
    """A search of world size 4 on a CPU, and the predicted step of world size 2's best plan."""
    options = CompileOptions(model=TINY_GPT, world_size=4, global_batch_size=8, measure=False, run_finalists=False)
    plan, _ = compile_plan(options)
    fewer, _ = compile_plan(dataclasses.replace(options, world_size=2))
    return options, plan, fewer.predicted.step_s


def _ran(plan, step_s: float | None):
    """``plan`` as if its finalists ran here, itself at ``step_s`` a step."""
    rows = [dict(row) for row in plan.provenance.search["ranked"]]
    rows[0]["measured_step_s"] = step_s
    search = dict(plan.provenance.search, ranked=rows, chosen_by="run")
    return dataclasses.replace(plan, provenance=dataclasses.replace(plan.provenance, search=search))


def _fewer(options, plan, basis=BASIS, cores=2):
    return with_fewer_ranks(options, plan, basis, cores=cores).provenance.search.get("fewer_ranks")


def _at_worst(step_s: float) -> float:
    """The slowest run a prediction of ``step_s`` allows at the band's worst |predicted - measured| / measured."""
    return step_s / (1 - BAND.worst)


def test_fewer_ranks_faster_even_at_the_worst_error_are_recorded_and_said(searched, tmp_path, monkeypatch,
                                                                        capsys) -> None:
    import autopart.driver
    import autopart.tools.cli

    options, plan, fewer_s = searched
    ran_s = _at_worst(fewer_s) * 1.01
    recorded = with_fewer_ranks(options, _ran(plan, ran_s), BASIS, cores=2)
    fewer = recorded.provenance.search["fewer_ranks"]
    assert fewer["world_size"] == 2 and fewer["predicted_step_s"] == fewer_s and fewer["error_worst"] == BAND.worst
    assert fewer["faster"] is True and fewer["seconds"] > 0
    assert fewer["layout"].startswith("pp") and " dp" in fewer["layout"]
    recorded.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").provenance.search["fewer_ranks"] == fewer
    monkeypatch.setattr(autopart.tools.cli, "usable_cores", lambda: 2)
    monkeypatch.setattr(autopart.driver, "compile_to_directory", lambda *args, **kwargs: (recorded, tmp_path))
    cli_main(["compile", str(TINY_GPT), "--world-size", "4", "--global-batch-size", "8", "-o", str(tmp_path / "o")])
    printed = " ".join(capsys.readouterr().out.split())
    assert (f"its 4 ranks take turns on this machine's 2 cores: the best plan of 2 ({fewer['layout']}) is predicted "
            f"at {fewer_s * 1e3:.1f} ms a step (cost_accuracy: worst 20%), this one ran at {ran_s * 1e3:.1f} ms: "
            "--world-size 2 trains faster here") in printed
    assert "may train faster" not in printed


def test_fewer_ranks_within_the_band_are_recorded_not_faster_and_said_so(searched, tmp_path, monkeypatch,
                                                                         capsys) -> None:
    import autopart.driver
    import autopart.tools.cli

    options, plan, fewer_s = searched
    ran_s = _at_worst(fewer_s) * 0.99
    recorded = with_fewer_ranks(options, _ran(plan, ran_s), BASIS, cores=2)
    assert recorded.provenance.search["fewer_ranks"]["faster"] is False
    monkeypatch.setattr(autopart.tools.cli, "usable_cores", lambda: 2)
    monkeypatch.setattr(autopart.driver, "compile_to_directory", lambda *args, **kwargs: (recorded, tmp_path))
    cli_main(["compile", str(TINY_GPT), "--world-size", "4", "--global-batch-size", "8", "-o", str(tmp_path / "o")])
    printed = " ".join(capsys.readouterr().out.split())
    assert f"this one ran at {ran_s * 1e3:.1f} ms, not faster by more than that error" in printed
    assert "trains faster here" not in printed and "may train faster" not in printed


def test_nothing_is_searched_at_one_rank_per_core_or_where_nothing_ran(searched) -> None:
    options, plan, fewer_s = searched
    slow = _ran(plan, _at_worst(fewer_s) * 1.01)
    assert _fewer(options, slow) is not None
    assert _fewer(options, slow, cores=4) is None  # a rank per core already
    assert _fewer(options, _ran(plan, None)) is None  # the finalists did not run
    assert _fewer(options, slow, basis=dataclasses.replace(BASIS, band=None)) is None  # no band to weigh it by
    assert _fewer(dataclasses.replace(options, device="h100-sxm"), slow) is None  # not this machine


def test_where_fewer_ranks_cannot_keep_the_pins_the_reason_is_recorded(searched) -> None:
    options, plan, _ = searched
    pinned = dataclasses.replace(options, dp=4)  # world size 2 has no room for four replicas
    fewer = _fewer(pinned, _ran(plan, 10.0))
    assert set(fewer) == {"world_size", "reason", "seconds"} and fewer["reason"]


def test_a_compile_asks_for_fewer_ranks_with_the_basis_it_prints(monkeypatch) -> None:
    """The driver's compile hands its plan and basis to `with_fewer_ranks` (which decides)."""
    import autopart.driver

    asked = []
    monkeypatch.setattr(autopart.driver, "with_fewer_ranks",
                        lambda options, plan, basis, progress=None: asked.append((options, basis)) or plan)
    options = CompileOptions(model=TINY_GPT, world_size=4, global_batch_size=8, measure=False, run_finalists=False)
    plan, _ = autopart.driver.measured_plan(options)
    assert len(asked) == 1 and asked[0][0].world_size == 4 and asked[0][1].what == plan.predicted.basis


def test_fewer_ranks_of_a_layout_no_row_ran_are_said_without_a_band(searched, tmp_path, monkeypatch, capsys) -> None:
    """Where the band's rows ran other layouts than the fewer ranks' plan, it has no worst error:
    the line formatted None ('unsupported format string passed to NoneType') and the compile ended
    in a traceback after writing OUT."""
    import autopart.driver
    import autopart.tools.cli

    options, plan, fewer_s = searched
    other = dataclasses.replace(BASIS, band=dataclasses.replace(BAND, layouts=("tp",)))  # none of this plan's
    recorded = with_fewer_ranks(options, _ran(plan, _at_worst(fewer_s) * 2), other, cores=2)
    fewer = recorded.provenance.search["fewer_ranks"]
    assert fewer["error_worst"] is None and fewer["faster"] is False
    assert fewer["error_benchmark"] == "cost_accuracy's rows ran tp plans alone"
    monkeypatch.setattr(autopart.tools.cli, "usable_cores", lambda: 2)
    monkeypatch.setattr(autopart.driver, "compile_to_directory", lambda *args, **kwargs: (recorded, tmp_path))
    cli_main(["compile", str(TINY_GPT), "--world-size", "4", "--global-batch-size", "8", "-o", str(tmp_path / "o")])
    printed = " ".join(capsys.readouterr().out.split())
    assert (f"({fewer['layout']}) is predicted at {fewer_s * 1e3:.1f} ms a step (no band: cost_accuracy's rows ran "
            "tp plans alone)") in printed and "whether it is faster is not known" in printed
