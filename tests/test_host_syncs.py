"""What a training step makes the host wait for: on a GPU every synchronize and every read of a
tensor's value stops the host until the device has run what was queued, and the device then idles
while the host prepares what follows. A step waits once, at its end (its time, and ``--seconds``'s
stop, need it); the values reported are read on the reporting rank alone, after that wait. The
ranks run with gloo on the CPU under ``tests/host_reads.py``, which counts the waits per step."""

import json

import pytest

from autopart.driver import CompileOptions, compile_to_directory
from autopart.runtime.mesh import Mesh
from tests.distributed import REPO, run_ranks
from tests.host_reads import READS

pytestmark = pytest.mark.multiprocess

STEPS = 4


@pytest.mark.parametrize("metrics, reads", [(False, 3), (True, 4)], ids=["", "--metrics"])
def test_a_step_waits_for_the_device_once_and_only_the_reporter_reads_values(tmp_path, metrics, reads):
    """Under dp 2 every replica holds a loss and all-reduces it, and both clip: only replica 0,
    which reports, reads the loss, the step's time and the gradient norm, and with --metrics
    every rank's peak memory, gathered into one tensor."""
    out = tmp_path / "out"
    plan, _ = compile_to_directory(CompileOptions(model=REPO / "tests" / "models" / "tiny_gpt.py", pp=1, dp=2,
                                                  microbatches=2, micro_batch_size=1, optimizer="adamw",
                                                  measure=False), out)
    report = tmp_path / "reads.jsonl"
    flags = ["--metrics", str(tmp_path / "metrics.jsonl")] if metrics else []
    run_ranks(out, 2, "--steps", str(STEPS), "--optimizer", "adamw", "--lr", "1e-3", "--clip-grad-norm", "0.05",
              *flags, env={"AUTOPART_HOST_READS": str(report)})
    counted = {line["rank"]: line["steps"] for line in map(json.loads, report.read_text().splitlines())}
    assert sorted(counted) == [0, 1] and all(len(steps) == STEPS for steps in counted.values()), counted
    reporter = next(r for r in range(2) if Mesh.of(plan).coordinates(r).dp == 0)
    for rank, steps in counted.items():
        for step, counts in enumerate(steps[1:-1], start=1):  # past the first step's settling, before the last's end
            read = {name: counts[name] for name in READS if counts.get(name)}
            assert counts.get("synchronize", 0) <= 1, (rank, step, counts)
            if rank == reporter:
                assert sum(read.values()) <= reads, (rank, step, read)
            else:
                assert not read, (rank, step, read)
