"""How much slower a model computes with the other ranks of its host computing beside it.

The in-place profile (`autopart.profiling.in_situ`) times the graph in one process with the
machine to itself. In training, every rank of the host computes at once: on a CPU, the other
ranks' work shares the last-level cache, the memory bus and, on a virtual machine, whatever
the host gives the virtual cores under load, and each rank's compute runs slower for it. This
module measures that slowdown for the model at hand, as a factor on its measured compute:

the graph's forward and backward is run whole, in this process, alternately with its
co-runners stopped and with them running, in short rounds (this machine's speed moves within
seconds, so the two are compared a fraction of a second apart and the answer is the median
over the rounds); the co-runners are copies of this process (forked, one thread each, as
``torchrun`` starts each rank) that run the same forward and backward in a loop. As many
processes compute as the plan's ranks on one host can compute at once: its ranks there, at
most one per core (where the ranks outnumber the cores, the step model shares the cores
itself, and at any moment only one rank per core computes).

Each co-runner counts its runs in shared memory, so the measurement knows how many processes
really computed together (`CoRunMeasurement.processes`), not how many were asked for: a
co-runner that never got to run would leave the factor that of fewer.

Every rank runs the whole model here, where in a pipeline each runs its stage: the same kind
of work at the model's sizes, with a larger footprint than a stage's; the factor is what the
model's ops suffer beside copies of themselves. The messages landing mid-compute, waking after
a wait and refilling a shared core stay the step model's (``profile-comm``'s figures);
``--profile-pipeline`` measures all of it in the running pipeline.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import statistics
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from autopart.profiling.in_situ import left_as_it_was, trimmed_mean
from autopart.profiling.span import span
from cost_models.database import CoRunMeasurement

__all__ = ["co_run_key", "host_processes", "measure_co_run", "ROUNDS", "MIN_SECONDS"]

ROUNDS = 8
"""Rounds at least, each timing the graph alone and beside its co-runners."""
RUNS = 4
"""Runs of the graph timed per phase of a round at least (after one left out as the phase starts) ..."""
PHASE_S = 0.05
"""... and seconds they span at least: several of the scheduler's slices, for a small model."""
MIN_SECONDS = 2.0
"""Seconds the rounds span at least (more rounds for a small model)."""
MAX_ROUNDS = 40
"""Rounds at most, however short the model's runs."""
MAX_SECONDS = 8.0
"""Seconds after which the rounds stop once `MIN_ROUNDS` are done (a large model's runs are
long: the compile's measuring stays within seconds) ..."""
MIN_ROUNDS = 3
PHASE_MAX_S = 0.5
"""... and after which a phase stops once it has two runs."""
WARM_UP_S = 10.0
"""Seconds the co-runners get at most for their first two runs, before any is timed."""


def co_run_key(dtype: str, processes: int) -> str:
    """The cost database's key of a model's co-run slowdown (the database is per model and
    machine already): one per precision and number of processes, measured at the first
    micro-batch size a compile reaches, so that a search over sizes measures it once."""
    return f"co_run(dtype={dtype}, processes={processes})"


def host_processes(ranks_on_host: int, cores: int) -> int:
    """How many of a host's ranks compute at once: each of them, up to one per core."""
    return max(1, min(ranks_on_host, cores))


def _run(module: fx.GraphModule, args: Sequence[Any], forward_context: Callable) -> None:
    with forward_context():
        loss = module(*args)
    if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
        loss.backward(torch.ones_like(loss))


def _co_runner(module: fx.GraphModule, args: Sequence[Any], forward_context: Callable, counts: mmap.mmap,
               slot: int) -> None:
    """A forked co-runner: the graph's forward and backward until killed, counting its runs.

    One thread, as a rank under torchrun: and a forked child must not enter an OpenMP parallel
    region, whose pool threads the fork left behind in the parent (it would wait for them forever)."""
    try:
        torch.set_num_threads(1)
        with torch.enable_grad():
            runs = 0
            while True:
                _run(module, args, forward_context)
                for parameter in module.parameters():
                    parameter.grad = None
                runs += 1
                counts[8 * slot:8 * slot + 8] = struct.pack("q", runs)
    finally:
        os._exit(0)


def measure_co_run(module: fx.GraphModule, args: Sequence[Any], *, processes: int,
                   forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                   rounds: int = ROUNDS, min_seconds: float | None = None) -> CoRunMeasurement:
    """The graph's forward and backward beside ``processes - 1`` copies of itself against alone
    (the median over at least ``rounds`` rounds spanning ``min_seconds``, by default `MIN_SECONDS`
    capped by `autopart.profiling.span`), in CPU time: the
    step model shares the cores among the ranks and the machine's other busy processes itself,
    so what is measured here is how much slower a rank computes while it has a core (shared
    caches and memory bus, a virtual core's sibling busy), not how long it waits for one. Leaves
    ``module``'s parameters without gradients and its buffers and the random state as they were.
    With one process, or where this system cannot fork, nothing is run: a factor of 1."""
    if processes <= 1 or not hasattr(os, "fork"):
        return CoRunMeasurement(processes=1, factor=1.0)
    module.code  # a lazily written module (autopart.passes.capture) writes its code once, not in each fork
    counts = mmap.mmap(-1, 8 * (processes - 1))
    children = []
    for slot in range(processes - 1):
        child = os.fork()
        if child == 0:
            _co_runner(module, args, forward_context, counts, slot)
        os.kill(child, signal.SIGSTOP)
        children.append(child)

    def signal_all(which: int) -> None:
        for child in children:
            os.kill(child, which)

    def counted() -> list[int]:
        return [struct.unpack("q", counts[8 * i:8 * i + 8])[0] for i in range(processes - 1)]

    def phase(together: bool) -> tuple[float, list[bool]]:
        """(trimmed mean seconds of a run, per co-runner whether it ran meanwhile) of one phase."""
        before = counted()
        if together:
            signal_all(signal.SIGCONT)
        try:
            _run(module, args, forward_context)  # left out: the co-runners take their cores back
            seconds: list[float] = []
            began = time.perf_counter()
            while (len(seconds) < RUNS or time.perf_counter() - began < PHASE_S) and \
                    not (len(seconds) >= 2 and time.perf_counter() - began > PHASE_MAX_S):
                start = time.thread_time()
                _run(module, args, forward_context)
                seconds.append(time.thread_time() - start)
        finally:
            if together:
                signal_all(signal.SIGSTOP)
        return trimmed_mean(seconds), [after > first for after, first in zip(counted(), before)]

    ratios, alongside = [], []
    try:
        # a fresh fork's first runs copy the pages it writes and fill its allocator: they run
        # while this process runs its own first ones, and are not timed
        signal_all(signal.SIGCONT)
        warm_until = time.perf_counter() + WARM_UP_S
        while min(counted()) < 2 and time.perf_counter() < warm_until:
            time.sleep(0.01)
        signal_all(signal.SIGSTOP)
        spanning = span(MIN_SECONDS) if min_seconds is None else min_seconds
        with left_as_it_was(module), torch.enable_grad():
            started, done = time.perf_counter(), 0
            while done < MAX_ROUNDS and (done < rounds or time.perf_counter() - started < spanning) and \
                    not (done >= MIN_ROUNDS and time.perf_counter() - started > MAX_SECONDS):
                # which phase comes first alternates: a phase that follows the other inherits its caches
                first, second = phase(done % 2 == 1), phase(done % 2 == 0)
                (alone, _), (beside, ran) = (second, first) if done % 2 else (first, second)
                ratios.append(beside / alone)
                alongside.append(ran)
                done += 1
    finally:
        signal_all(signal.SIGKILL)
        for child in children:
            os.waitpid(child, 0)
        counts.close()
    # a co-runner counts where it ran in most rounds: one the machine's other work kept off
    # the cores for a moment still computed beside this process in the others
    ran_most = sum(2 * sum(round_[i] for round_ in alongside) >= len(alongside) for i in range(processes - 1))
    return CoRunMeasurement(processes=1 + ran_most, factor=max(1.0, statistics.median(ratios)), rounds=len(ratios))
