"""Choose among a search's finalists by running them, where they can run: on this machine.

The step model ranks a search's layouts, and on the machine at hand it is right to a band
(``autopart/predict/accuracy.json``), not to the order of plans a few percent apart: which of
ZeRO-1 and ZeRO-2, of one pipeline and two data-parallel copies, runs faster on a laptop's
cores moves with costs no model here weighs exactly (FSDP's per-tensor dispatch on a CPU, four
ranks taking turns on two cores). Where every rank of the search's plans runs on this host, a
compile need not trust the ranking: it emits each finalist, runs it here for a few seconds
(``train.py --metrics``, the runtime the user will launch) and keeps the fastest. This is what
an autotuner does with its candidates; the step model still chooses which few to run.

Each finalist runs once; those within `CLOSE` of the fastest run again, the order reversed (a
machine that slows or speeds up through the runs then favours neither end), and each is
judged by the median of its launches' median steps. The plan kept records every finalist's
measured step beside its prediction (``provenance.search.ranked[*].measured_step_s``) and its
own as ``predicted.profiled_step_s``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from autopart.codegen.emit import emit_directory
from autopart.ir.errors import ConfigError
from autopart.ir.plan import Plan
from autopart.options import CompileOptions, local_kind
from autopart.passes.front import Front
from autopart.profiling.measure_defaults import NO_MEASURE_ENV
from autopart.profiling.span import span
from autopart.tools.local_run import run_locally, runs_on_gpus
from cost_models.calibration import usable_cores

__all__ = ["CLOSE", "Finalist", "chosen_by_running", "finalist_step_s", "finalists_run_here", "run_finalists"]

WARMUP_STEPS = 3  # left out: the first steps allocate and fill the caches
MEASURED_STEPS = 8  # at least; and at least
MEASURED_SECONDS = 1.0  # by the plan's predicted step (capped by `autopart.profiling.span`)
MAX_STEPS = 200
CLOSE = 0.15
"""Finalists whose first run came within this fraction of the fastest run again: a launch's
median step on a shared machine moves by about this much from one launch to the next."""


RANKS_PER_CORE = 4
"""At most this many ranks per core are run (on a CPU): more take minutes per finalist."""


def finalists_run_here(options: CompileOptions) -> bool:
    """Whether a compile with ``options`` runs its search's finalists here: ``--run-finalists``
    asked it, or by default, where the device is this machine's, measuring is on and the ranks
    can run on it; a refusal in one line where it was asked and they cannot."""
    if not options.searched or options.run_finalists is False:
        return False
    asked = options.run_finalists is True
    if not asked and (not options.measure or os.environ.get(NO_MEASURE_ENV)):
        return False
    why = _why_not_here(options)
    if why is not None and asked:
        raise ConfigError(f"--run-finalists runs the plans on this machine, and {why}; drop --run-finalists")
    return why is None


def _why_not_here(options: CompileOptions) -> str | None:
    kind = local_kind(options.device)
    ranks = options.world_size
    if kind is None:
        return f"--device {options.device} is not this machine's"
    if ranks > options.gpus_per_node:
        return f"--world-size {ranks} spans more than one node of {options.gpus_per_node} (--gpus-per-node)"
    if kind == "cpu" and ranks > RANKS_PER_CORE * usable_cores():
        return f"--world-size {ranks} is more than {RANKS_PER_CORE} ranks per core of its {usable_cores()}"
    if kind != "cpu" and torch.cuda.device_count() < ranks:
        return f"it has {torch.cuda.device_count()} GPUs for --world-size {ranks}"
    return None


@dataclass(frozen=True)
class Finalist:
    plan: Plan
    front: Front  # what its programs are emitted from


def finalist_step_s(finalist: Finalist, *, timeout_s: float = 600.0) -> float:
    """The median step of one launch of ``finalist``'s programs here, its first steps left out."""
    plan = finalist.plan
    steps = max(MEASURED_STEPS, min(MAX_STEPS, math.ceil(span(MEASURED_SECONDS) / max(plan.predicted.step_s, 1e-6))))
    with tempfile.TemporaryDirectory(prefix="autopart-finalist-") as folder:
        work = Path(folder)
        out = emit_directory(plan, finalist.front.op_graph, finalist.front.spec, work / "out",
                             chain=finalist.front.chain)
        metrics = work / "metrics.jsonl"
        run_locally(out, plan.world_size, ["--steps", str(WARMUP_STEPS + steps), "--metrics", str(metrics)],
                    timeout_s=timeout_s, cwd=work, gpus=runs_on_gpus(plan))
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return statistics.median(record["step_s"] for record in records[WARMUP_STEPS:])


def chosen_by_running(count: int, run: Callable[[int], float],
                      heard: Callable[[int, int], None] | None = None) -> tuple[int, dict[int, list[float]]]:
    """(the index of the fastest of ``count`` finalists, each one's measured steps): each run
    once by ``run(index)``, those within `CLOSE` of the fastest once more in reverse order, and
    judged by the median of their runs. ``heard(done, total)`` follows the runs."""
    measured: dict[int, list[float]] = {index: [] for index in range(count)}
    total = count
    for index in range(count):
        measured[index].append(run(index))
        if heard is not None:
            heard(index + 1, total)
    fastest = min(seconds[0] for seconds in measured.values())
    close = [index for index in range(count) if measured[index][0] <= fastest * (1 + CLOSE)]
    if len(close) > 1:
        total += len(close)
        for done, index in enumerate(reversed(close), start=count + 1):
            measured[index].append(run(index))
            if heard is not None:
                heard(done, total)
    chosen = min(range(count), key=lambda index: (statistics.median(measured[index]), index))
    return chosen, measured


def run_finalists(finalists: list[Finalist], *, progress: Callable[[str, int, int], None] | None = None
                  ) -> tuple[Plan, Front]:
    """The fastest of ``finalists`` (the search's, best predicted first) as run here, its plan
    recording every finalist's measured step. One finalist is returned as it is."""
    first = finalists[0].plan
    if len(finalists) < 2:
        return first, finalists[0].front

    def heard(done: int, total: int) -> None:
        if progress is not None:
            progress("running the finalists here", done, total)

    start = time.perf_counter()
    chosen, measured = chosen_by_running(len(finalists), lambda i: finalist_step_s(finalists[i]), heard)
    steps = {i: statistics.median(seconds) for i, seconds in measured.items()}
    search = first.provenance.search
    # the search's rows, best predicted first, are the finalists in the same order; the chosen one goes first
    rows = [dict(row, measured_step_s=steps[i], launches=len(measured[i])) for i, row in enumerate(search["ranked"])
            if i < len(finalists)]
    rows = [rows[chosen], *(row for i, row in enumerate(rows) if i != chosen)]
    search = dict(search, ranked=rows, chosen_by="run", run_seconds=round(time.perf_counter() - start, 3))
    plan = finalists[chosen].plan
    plan = replace(plan, predicted=replace(plan.predicted, profiled_step_s=steps[chosen]),
                   provenance=replace(plan.provenance, search=search))
    return plan, finalists[chosen].front
