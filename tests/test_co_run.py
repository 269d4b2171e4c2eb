"""The model timed beside copies of itself, as many as the plan's ranks on one host compute at
once: the measurement runs real concurrent processes and says how many ran, the cost database
keeps it per precision and processes, and a plan reads the entry of its own host's ranks (a plan
spread over hosts: only the ranks of one)."""

import os
from pathlib import Path

import pytest
import torch
from torch import fx, nn

import autopart
from autopart.driver import CompileOptions
from autopart.ir.model_file import load_model_file
from autopart.passes.capture import capture
from autopart.predict.accuracy import basis_for
from autopart.profiling.co_run import co_run_key, host_processes, measure_co_run
from autopart.profiling.measure_defaults import NO_MEASURE_ENV, co_run_processes
from autopart.profiling.profile import profile_costs
from cost_models.calibration import usable_cores
from cost_models.database import CoRunMeasurement, CostDatabase
from cost_models.devices import local_device_name

from tests.test_measure_defaults import MODEL


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.head(torch.relu(self.fc(x))).sum()


def test_the_copies_compute_at_the_same_time_and_the_entry_says_how_many() -> None:
    module = fx.symbolic_trace(_Net())
    pid = os.getpid()
    measured = measure_co_run(module, [torch.randn(32, 64)], processes=2, rounds=3, min_seconds=0.5)
    assert os.getpid() == pid  # the copies ended where they ran
    # counted from the copy's own runs inside the timed windows: a copy that never ran alongside
    # (stopped, dead, run after this process) would leave 1
    assert measured.processes == 2 and measured.rounds >= 3
    assert measured.factor >= 1.0
    assert all(p.grad is None for p in module.parameters()) and all(b.item() == 0 for b in module.buffers())


def test_one_process_runs_nothing() -> None:
    module = fx.symbolic_trace(_Net())
    assert measure_co_run(module, [torch.randn(4, 64)], processes=1) == CoRunMeasurement(processes=1, factor=1.0)
    assert all(b.item() == 0 for b in module.buffers())


@pytest.mark.parametrize("pp, dp, world, per_node, ranks_on_host", [
    (2, 1, None, 8, 2),
    (2, 2, None, 8, 4),
    (4, 1, None, 2, 2),  # spread over two hosts: each host's cores are shared by its own two
    (2, 1, None, 1, 1),
    (None, None, 16, 8, 8),  # searched: the world's ranks, up to a node's
])
def test_the_ranks_of_one_host(pp, dp, world, per_node, ranks_on_host) -> None:
    options = CompileOptions(model=MODEL, pp=pp, dp=dp, world_size=world, gpus_per_node=per_node)
    assert options.ranks_per_host == ranks_on_host
    assert host_processes(ranks_on_host, 2) == min(ranks_on_host, 2)  # at most one computing per core
    assert host_processes(ranks_on_host, 0) == 1  # a device without shared cores


def _database_with_co_runs(tmp_path) -> CostDatabase:
    """MODEL's ops profiled alone at micro-batch size 2, and a co-run entry for every process count with a factor of
    its own (1 + processes / 10), so that a plan's factor names the entry it read."""
    spec = load_model_file(MODEL)
    database = CostDatabase.load(tmp_path / "costs.json")
    profile_costs(capture(spec, batch_size=2), spec, database, micro_batch_size=2)
    for processes in (2, 3, 4):
        database.put_co_run(local_device_name("cpu"), co_run_key("fp32", processes),
                            CoRunMeasurement(processes=processes, factor=1 + processes / 10, rounds=8, micro_batch_size=2))
    database.save()
    return CostDatabase.load(database.path)  # through the file, as a later compile reads it


def test_a_plan_reads_the_entry_measured_with_its_hosts_ranks(tmp_path) -> None:
    costs = _database_with_co_runs(tmp_path).path
    processes = host_processes(2, usable_cores())
    plan = autopart.compile(MODEL, pp=2, microbatches=2, micro_batch_size=2, costs=costs)
    if processes < 2:
        pytest.skip("one core: two ranks never compute at once")
    assert plan.predicted.compute_factor_from == "co-run"
    assert plan.predicted.compute_factor == pytest.approx((1 + processes / 10,) * 2)

    replicas = autopart.compile(MODEL, dp=2, microbatches=1, micro_batch_size=2, costs=costs)  # two ranks of data parallelism, too
    assert replicas.predicted.compute_factor_from == "co-run"

    one_per_host = autopart.compile(MODEL, pp=2, microbatches=2, micro_batch_size=2, gpus_per_node=1, costs=costs)
    assert one_per_host.predicted.compute_factor_from != "co-run"  # alone on its host: the 2-process entry is not its


def test_an_entry_of_another_precision_is_not_read(tmp_path) -> None:
    costs = _database_with_co_runs(tmp_path).path
    if usable_cores() < 2:
        pytest.skip("one core: two ranks never compute at once")
    plan = autopart.compile(MODEL, pp=2, microbatches=1, micro_batch_size=2, dtype="bf16-autocast", costs=costs)
    assert plan.predicted.compute_factor_from != "co-run"  # only fp32 was measured


def test_the_database_keeps_the_co_runs(tmp_path) -> None:
    database = CostDatabase(path=tmp_path / "costs.json")
    entry = CoRunMeasurement(processes=2, factor=1.23, rounds=9, micro_batch_size=4)
    database.put_co_run("cpu", co_run_key("bf16", 2), entry)
    database.save()
    again = CostDatabase.load(tmp_path / "costs.json")
    assert again.co_run("cpu", co_run_key("bf16", 2)) == entry
    assert again.co_run("cpu", co_run_key("fp32", 2)) is None and again.co_run("cpu", co_run_key("bf16", 3)) is None


def test_the_basis_says_the_ops_were_timed_among_the_hosts_ranks() -> None:
    at_once = "(timed 2 at once, as the plan's ranks on this host compute)"
    measured = basis_for(device="cpu", local="cpu", measured=True, costs=None, messages=True, co_run=2, bands={})
    assert measured.what == f"ops {at_once} and messages measured on this machine"
    given = basis_for(device="cpu", local="cpu", measured=False, costs=Path("c.json"), messages=True, co_run=2, bands={})
    assert given.what == f"ops from c.json {at_once}, messages measured on this machine"
    alone = basis_for(device="cpu", local="cpu", measured=True, costs=None, messages=True, co_run=1, bands={})
    assert alone.what == "ops and messages measured on this machine"
    pipeline = basis_for(device="cpu", local="cpu", measured=False, costs=Path("c.json"), messages=True, co_run=2,
                         pipeline=True, bands={})
    assert "at once" not in pipeline.what  # the pipeline's own run holds it


def test_the_basis_says_when_the_host_s_ranks_outnumber_its_cores() -> None:
    """Four ranks on two cores take turns there, which neither the timing nor the step counts."""
    crowded = basis_for(device="cpu", local="cpu", measured=True, costs=None, messages=True, co_run=2, ranks_on_host=4,
                        bands={})
    assert crowded.what == ("ops (timed 2 at once, one per core; the plan's 4 ranks on this host take turns on its 2 "
                            "cores, as the step counts them) and messages measured on this machine")
    one_core = basis_for(device="cpu", local="cpu", measured=True, costs=None, messages=True, co_run=1, ranks_on_host=2,
                         bands={})
    assert "the plan's 2 ranks on this host take turns on its 1 core," in one_core.what
    fitting = basis_for(device="cpu", local="cpu", measured=True, costs=None, messages=True, co_run=2, ranks_on_host=2,
                        bands={})
    assert fitting.what == "ops (timed 2 at once, as the plan's ranks on this host compute) and messages measured on this machine"


def test_measuring_off_times_among_no_others(monkeypatch) -> None:
    options = CompileOptions(model=MODEL, pp=2)
    assert co_run_processes(options, "cpu", 2) == 1  # the suite's conftest turns measuring off
    monkeypatch.delenv(NO_MEASURE_ENV)
    assert co_run_processes(options, "cpu", 2) == 2
    assert co_run_processes(options, "cuda", 2) == 1 and co_run_processes(options, None, 2) == 1
    assert co_run_processes(CompileOptions(model=MODEL, pp=2, measure=False), "cpu", 2) == 1
