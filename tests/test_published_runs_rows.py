"""benchmarks/published_runs.py, run by hand, holds the predictions to published training runs;
here one row of each kind still compiles in its published layout (a refusal added to the options
once failed every TP-1 row, and the benchmark printed the rest as if nothing had happened)."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "published_runs.py"


def test_a_row_of_each_kind_compiles_in_its_published_layout(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path))
    spec = importlib.util.spec_from_file_location("published_runs", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "published_runs", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    rows = ["mpt-7b-128",  # ZeRO-3 at TP 1
            "megascale-175b-256",  # TP with sequence parallelism, interleaved
            "mt-nlg-530b-2240"]  # TP without it, full recompute, stages pinned
    written = {}  # the bands the run writes: for the layouts its rows ran alone
    monkeypatch.setattr(bench, "write_band", lambda key, band: written.setdefault(key, band) and tmp_path)
    assert bench.main(["--rows", *rows]) == 0
    printed = capsys.readouterr().out
    assert "over 3 rows" in printed, printed
    assert {key: (band.layouts, band.zero) for key, band in written.items()} == {
        "spec-roofline": (("pp+tp+dp",), (1,)), "spec-roofline-zero3": (("dp",), (3,))}
