"""The measured timeline of one training step (``train.py --trace FILE``), and the seconds of each
action per step (``--action-times DIR``).

Every rank records when each of its actions starts and ends (`Executor.step(record=...)`), in
seconds after a barrier that all ranks leave together at the start of the step: the barrier is
the shared clock, so no two hosts' clocks need to agree, and ranks are aligned to within the
time it takes the barrier to release them (well under a millisecond on one host). Rank 0
gathers the events and writes them with `autopart.schedule.write_chrome_trace`, the writer of
compile's predicted ``trace.json``, so `read_chrome_trace` reads both and they open side by side
in Perfetto. Only compute actions (F, B, I, W) go into the timeline: a receive's wait is the
gap before the action that needed it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from autopart.runtime.device import barrier, synchronize
from autopart.runtime.exchange import gather_json
from autopart.runtime.executor import ActionRecord
from autopart.schedule import Action, Event, Timeline, write_chrome_trace

__all__ = ["StepClock", "StopRule", "write_action_times", "write_measured_trace"]


class StopRule:
    """When a run stops: after ``--steps``, or with ``--seconds``, after the first step at which the
    run's steps past its first ``untimed`` (a warm-up) took that long together and at least
    ``min_steps`` are done. A timing run asks for seconds, not steps, where a plan's step is known
    only roughly before it runs; each step's time is the one all ranks agreed on (its slowest
    rank's, all-reduced), so the same sums reach the bound at the same step everywhere and no
    rank waits for a peer that stopped. The learning-rate schedule still spans ``--steps``."""

    def __init__(self, first_step: int, steps: int, seconds: float | None, *, min_steps: int = 1,
                 untimed: int = 0) -> None:
        self.done, self.steps, self.seconds = first_step, steps, seconds
        self.min_steps, self.untimed = min_steps, untimed
        self.ran, self.spent = 0, 0.0

    def after(self, step_s: torch.Tensor) -> bool:
        """Whether the run stops after a step that took ``step_s`` (every rank's same figure)."""
        self.done, self.ran = self.done + 1, self.ran + 1
        if self.seconds is None:
            return self.done >= self.steps
        if self.ran > self.untimed:  # read (a device sync on a GPU) only where seconds are counted
            self.spent += float(step_s.item())
        return self.done >= self.steps or (self.ran >= self.min_steps and self.spent >= self.seconds)


class StepClock:
    """Start of a measured step, the same instant on every rank (up to the barrier's release)."""

    def __init__(self, device: torch.device) -> None:
        synchronize(device)  # what the previous step launched is not this step's
        barrier(device)
        self.origin = time.perf_counter()
        self.record: list[ActionRecord] = []


def write_measured_trace(
    clock: StepClock,
    *,
    ranks: int,
    path: Path,
    title: str,
    pipeline_rank: Callable[[int], int | None] = lambda r: r,
) -> Timeline | None:
    """Gather every rank's events on rank 0 and write them as a Chrome trace; rank 0 returns the timeline.

    ``pipeline_rank`` maps a global rank to the pipeline rank it is drawn as, or None to leave it out
    (with tensor and data parallelism, one (dp, tp) slice of the mesh stands for the others)."""
    mine = [
        (str(record.action), record.start - clock.origin, record.end - clock.origin)
        for record in clock.record
        if record.action.is_compute
    ]
    gathered = gather_json(mine, dst=0)
    if gathered is None:
        return None
    events = [
        Event(rank=pipeline_rank(r), action=Action.parse(name), start=start, end=end)
        for r, records in enumerate(gathered)
        if pipeline_rank(r) is not None
        for name, start, end in records
    ]
    timeline = Timeline.from_events(events, ranks=ranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(timeline, path, title=title)
    return timeline


def write_action_times(folder: Path, rank: int, step: int, origin: float, record: list[ActionRecord],
                       tail: tuple[float, float, float, float, float],
                       reduction: tuple[float, list[float]]) -> None:
    """One line of ``--action-times``: seconds from the step's start (``origin``, in
    ``time.perf_counter`` seconds, one clock for every process of a host), and CPU seconds. The
    tail: its start, end and CPU time, when the sums of tied gradients ended within it and when
    the optimizer step began (it runs to the end). ``reduced``: when the data-parallel
    all-reduce had ended (`autopart.runtime.reducer`; the tail's start without one), and
    ``buckets``: when each of its buckets was launched, during the actions."""
    folder.mkdir(parents=True, exist_ok=True)
    line = {
        "step": step,
        "origin": origin,
        "actions": [[str(r.action), r.start - origin, r.end - origin, r.cpu_s] for r in record],
        "tail": [tail[0] - origin, tail[1] - origin, tail[2], tail[3] - origin, tail[4] - origin],
        "reduced": reduction[0] - origin,
        "buckets": [launched - origin for launched in reduction[1]],
    }
    with open(folder / f"rank_{rank}.jsonl", "a") as file:
        file.write(json.dumps(line) + "\n")
