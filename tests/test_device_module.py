"""The runtime's device module and the local launcher's choice of devices, in one process with
no GPU: CUDA's answers are stood in for."""

from dataclasses import replace

import pytest
import torch

from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.errors import ConfigError
from autopart.tools.local_run import runs_on_gpus
from autopart.ir.plan import load_plan
from autopart.runtime import device
from autopart.runtime.data import split_microbatches
from autopart.runtime.launch import check_launch, older_torch
from autopart.runtime.device import batch_on_device
from tests.distributed import REPO


def test_the_device_module_picks_the_backend_and_refuses_a_rank_without_a_gpu(monkeypatch):
    assert device.backend(torch.device("cpu")) == "gloo" and device.backend(torch.device("cuda", 1)) == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.compute_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert device.compute_device() == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match="local rank 2 has no GPU of its own \\(2 visible\\)"):
        device.compute_device()
    monkeypatch.delenv("LOCAL_RANK")  # started by srun itself: its place on the node, not GPU 0 for all
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert device.compute_device() == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun's, where both are set (srun starting torchrun)
    assert device.compute_device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    # one GPU visible: a launcher that gave each process its own (srun) uses it; torchrun's
    # processes on a one-GPU machine would share it, and are refused
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert device.compute_device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="local rank 2 has no GPU of its own \\(1 visible\\)"):
        device.compute_device()
    timer = device.StepTimer(torch.device("cpu"))
    mark = timer.mark()
    assert timer.start <= timer.seconds(mark) <= timer.stop()
    started_over = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", started_over.append)
    device.reset_peak_memory(torch.device("cpu"))
    device.reset_peak_memory(torch.device("cuda", 1))
    assert started_over == [torch.device("cuda", 1)]  # a GPU's peak starts over before the first step
    barriers = []  # on a GPU the barrier names the rank's own device, which torch would guess (and warn)
    monkeypatch.setattr(torch.distributed, "barrier", lambda **options: barriers.append(options))
    device.barrier(torch.device("cuda", 1))
    device.barrier(torch.device("cpu"))
    assert barriers == [{"device_ids": [1]}, {"device_ids": None}]


def test_verify_runs_a_gpu_plan_on_the_gpus_only_with_one_per_rank(monkeypatch, tmp_path):
    plan, _ = compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=2,
                                                  device="h200"), tmp_path / "out")  # fmt: skip
    cpu_plan = replace(plan, provenance=replace(plan.provenance, cost_model="roofline:cpu"))
    assert load_plan(tmp_path / "out" / "plan.json").provenance.cost_model == "roofline:h200"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gpus, expected in ((2, True), (1, False)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        assert runs_on_gpus(plan) is expected
        assert runs_on_gpus(cpu_plan) is False


def test_a_step_s_batch_goes_to_the_device_once_and_only_what_its_stages_read():
    tokens, target = torch.arange(8).view(4, 2), torch.ones(4, 2)
    microbatches = split_microbatches((tokens, target, "flag"), 2)
    here = batch_on_device(microbatches, {0}, torch.device("cpu"))
    assert all(a is b for values, original in zip(here, microbatches) for a, b in zip(values, original))  # no copy
    moved = batch_on_device(microbatches, {0, 2}, torch.device("meta"))
    for values, original in zip(moved, microbatches, strict=True):
        assert values[0].device.type == "meta" and values[0].shape == original[0].shape
        assert values[1] is original[1] and values[2] == "flag"  # not read here; not a tensor


def test_a_plan_compiled_under_a_newer_torch_is_named_as_such(tmp_path, capsys):
    """A laptop's torch compiles for a cluster's older one: its stage files may call an op that
    torch lacks, which train.py's warning names as the cause before the first step fails
    (tests/test_plain_python_run.py); the launch checks, which explain and verify make too, say nothing."""
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=2, device="h200"),
                         tmp_path / "out")
    plan = load_plan(tmp_path / "out" / "plan.json")
    assert older_torch(plan) is None  # compiled here
    for version, older in (("99.1.0", True), ("2.4.0", False), (torch.__version__.split("+")[0] + "+cu128", False),
                           ("", False)):
        newer = replace(plan, provenance=replace(plan.provenance, torch_version=version))
        assert (older_torch(newer) is not None) is older, version
    newer = replace(plan, provenance=replace(plan.provenance, torch_version="99.1.0"))
    assert older_torch(newer) == ("the plan was compiled under torch 99.1.0 and runs under torch "
                                  f"{torch.__version__}; a stage that calls an op this torch lacks fails at its first "
                                  "step: compile under this torch if one does")
    check_launch(tmp_path / "out", newer, rank=0, world_size=2)
    assert capsys.readouterr().err == ""
