"""A rerun of train.py over its own outputs is let through: the checks that refuse a user's file
at an output path know train.py's files however long their lines grow."""

import functools

import pytest

import autopart
from autopart.ir.errors import ConfigError
from autopart.runtime.executor import ActionRecord
from autopart.runtime.measure import write_action_times
from autopart.runtime.train_flags import check_arguments, parse_args
from tests.distributed import REPO


@functools.cache
def plan():
    return autopart.compile(REPO / "examples" / "gpt.py", pp=2, microbatches=2, device="a100-80gb")


def checked(*flags: str) -> None:
    check_arguments(parse_args(["--steps", "1", *flags], plan()))


def test_a_long_step_of_action_times_or_metrics_is_train_py_s(tmp_path):
    """A step of a schedule of hundreds of microbatches writes a line of every action (~570 bytes
    a microbatch), and a step of many ranks' --metrics every rank's peak: past 64 KiB, which the
    check reads of the first line, a rerun was refused as 'not JSON lines of steps'."""
    actions = [ActionRecord(f"0F{m}", 1.0, 2.0, 0.5) for m in range(3000)]
    write_action_times(tmp_path / "times", 0, 0, 0.0, actions, (0.0, 1.0, 0.1, 0.5, 0.6), (0.5, [0.2] * 10))
    assert len((tmp_path / "times" / "rank_0.jsonl").read_bytes()) > 1 << 16
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "loss": 6.2, "peak_memory_bytes": [%s]}\n' % ", ".join(["123456789"] * 8000))
    checked("--action-times", str(tmp_path / "times"), "--metrics", str(metrics))
    (tmp_path / "notes.jsonl").write_text('{"mine": 1}\n')  # JSON, but not a step train.py wrote
    with pytest.raises(ConfigError, match="is not JSON lines of steps that train.py wrote"):
        checked("--metrics", str(tmp_path / "notes.jsonl"))
