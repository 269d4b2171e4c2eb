"""Every tensor that the generated programs hand to torch.distributed lives on its group's compute
device: on a GPU machine, NCCL raises at the first collective that gets a host tensor. The
ranks run with gloo on the CPU under ``tests/device_checker.py``, which plays the GPU's part for
the host (its docstring says how), and must train as one process does."""

import json

import pytest

from tests.distributed import assert_same_training, compile_and_train, run_ranks

pytestmark = pytest.mark.multiprocess


def _checked_calls(report) -> dict[int, dict[str, int]]:
    return {line["rank"]: line["checked"] for line in map(json.loads, report.read_text().splitlines())}


@pytest.mark.parametrize(
    ("pp", "dp", "calls"),
    [
        # the channels opened (send, recv), messages, tied gradients, step time, peaks
        (2, 1, {"send", "recv", "isend", "irecv", "all_reduce", "all_gather"}),
        (1, 2, {"all_reduce", "all_gather"}),  # data-parallel gradients and loss
    ],
)
def test_collectives_and_messages_carry_compute_device_tensors(tmp_path, pp, dp, calls):
    report = tmp_path / "checked.jsonl"
    run = compile_and_train(
        tmp_path, "gpt", pp=pp, dp=dp, microbatches=2, schedule="1f1b", optimizer="adamw", lr=1e-3,
        env={"AUTOPART_DEVICE_CHECK": str(report)}, trace=pp > 1,  # the trace's barrier, clock and gather too
        train_args=("--action-times", str(tmp_path / "actions"), "--checkpoint-dir", str(tmp_path / "checkpoints")),
    )  # fmt: skip
    checked = _checked_calls(report)
    assert sorted(checked) == list(range(pp * dp)), "every rank ran under the checker"
    assert calls <= {name for counts in checked.values() for name in counts}, checked
    report.unlink()
    assert_same_training(run, optimizer="adamw", lr=1e-3, param_atol=1e-5)
    resumed = run_ranks(run.out, pp * dp, "--steps", str(run.steps + 1), "--optimizer", "adamw", "--resume",
                        "--checkpoint-dir", str(tmp_path / "checkpoints"), env={"AUTOPART_DEVICE_CHECK": str(report)})
    assert f"step {run.steps} loss" in resumed.stdout  # the optimizer state read back, one more step taken
    for rank in range(pp * dp):  # every action timed, within the step
        for line in map(json.loads, (tmp_path / "actions" / f"rank_{rank}.jsonl").read_text().splitlines()):
            assert line["actions"] and all(0 <= start <= end <= line["tail"][1] for _, start, end, _ in line["actions"])
