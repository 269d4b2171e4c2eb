"""Every tensor that the generated programs hand to torch.distributed lives on its group's compute
device: on a GPU machine, NCCL raises at the first collective that gets a host tensor. The
ranks run with gloo on the CPU under ``tests/device_checker.py``, which plays the GPU's part for
the host (its docstring says how), and must train as one process does."""

import json

import pytest

from tests.distributed import assert_same_training, compile_and_train

pytestmark = pytest.mark.multiprocess


def _checked_calls(report) -> dict[int, dict[str, int]]:
    return {line["rank"]: line["checked"] for line in map(json.loads, report.read_text().splitlines())}


@pytest.mark.parametrize(
    ("pp", "dp", "calls"),
    [
        (2, 1, {"isend", "irecv", "all_reduce", "all_gather"}),  # messages, tied gradients, step time, peaks
        (1, 2, {"all_reduce", "all_gather"}),  # data-parallel gradients and loss
    ],
)
def test_collectives_and_messages_carry_compute_device_tensors(tmp_path, pp, dp, calls):
    report = tmp_path / "checked.jsonl"
    run = compile_and_train(
        tmp_path, "gpt", pp=pp, dp=dp, microbatches=2, schedule="1f1b", optimizer="adamw", lr=1e-3,
        env={"AUTOPART_DEVICE_CHECK": str(report)},
    )  # fmt: skip
    checked = _checked_calls(report)
    assert sorted(checked) == list(range(pp * dp)), "every rank ran under the checker"
    assert calls <= {name for counts in checked.values() for name in counts}, checked
    assert_same_training(run, optimizer="adamw", lr=1e-3, param_atol=1e-5)
