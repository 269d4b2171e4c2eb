"""Choose among a search's finalists by running them, where they can run: on this machine.

The step model ranks a search's layouts, and on the machine at hand it is right to a band
(``autopart/predict/accuracy.json``), not to the order of plans a few percent apart: which of
ZeRO-1 and ZeRO-2, of one pipeline and two data-parallel copies, runs faster on a laptop's
cores moves with costs no model here weighs exactly (FSDP's per-tensor dispatch on a CPU, four
ranks taking turns on two cores). Where every rank of the search's plans runs on this host, a
compile need not trust the ranking: it emits each finalist, runs it here for about a second of
steps (``train.py --metrics``, the runtime the user will launch) and keeps the fastest. This is
what an autotuner does with its candidates; the step model still chooses which few to run.

Each finalist runs once; those within `CLOSE` of the fastest run again, the order reversed (a
machine that slows or speeds up through the runs then favours neither end), and each is
judged by the median of its launches' median steps. A finalist whose launch fails is left out
(its row says why), so a runner-up's failure does not fail the compile. The plan kept records
every finalist's measured step beside its prediction
(``provenance.search["ranked"][*]["measured_step_s"]``, its own row first, ``chosen_by: "run"``).

What they measured is kept (`autopart.profiling.finalist_cache`), as the op profile is: a
second compile whose finalists are the same plans reads their steps back and launches nothing;
``--run-finalists`` runs them afresh.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from autopart.codegen.emit import emit_directory
from autopart.ir.errors import ConfigError
from autopart.ir.plan import Plan
from autopart.options import CompileOptions
from autopart.passes.front import Front
from autopart.profiling import finalist_cache
from autopart.profiling.measure_defaults import NO_MEASURE_ENV, RANKS_PER_CORE, why_not_here
from autopart.profiling.span import timed_run
from autopart.solve.planner import Finalist
from autopart.tools.local_run import LocalRunError, run_locally, runs_on_gpus

__all__ = ["CLOSE", "chosen_by_running", "finalist_step_s", "finalists_run_here", "run_finalists"]

log = logging.getLogger("autopart")

WARMUP_STEPS = 3  # left out: the first steps allocate and fill the caches
MEASURED_STEPS = 8  # at least; and at least
MEASURED_SECONDS = 1.0  # the run's steps together (capped by `autopart.profiling.span`)
MAX_STEPS = 100  # whatever the seconds: a plan of a millisecond a step has its fixed costs per step besides
TIMEOUT_S = 300.0  # a launch that takes longer is taken as failed
CLOSE = 0.15
"""Finalists whose first run came within this fraction of the fastest run again: a launch's
median step on a shared machine moves by about this much from one launch to the next."""



def finalists_run_here(options: CompileOptions) -> bool:
    """Whether a compile with ``options`` runs its search's finalists here: ``--run-finalists``
    asked it, or by default, where the device is this machine's, measuring is on, the ranks can
    run on it and ``--profile-pipeline`` (which runs the plan its own way) is not given; a
    refusal in one line where it was asked and they cannot."""
    if not options.searched or options.run_finalists is False:
        return False
    asked = options.run_finalists is True
    if asked and options.profile_pipeline:
        raise ConfigError("--profile-pipeline runs the plan it compiles, and --run-finalists the search's "
                          "finalists before it: give one of them")
    if not asked and (not options.measure or os.environ.get(NO_MEASURE_ENV) or options.profile_pipeline):
        return False
    why = why_not_here(options, RANKS_PER_CORE[asked])
    if why is not None and asked:
        raise ConfigError(f"--run-finalists runs the plans on this machine, and {why}; drop --run-finalists")
    return why is None


def finalist_step_s(finalist: Finalist, *, timeout_s: float = TIMEOUT_S) -> float:
    """The median step of one launch of ``finalist``'s programs here, its first steps left out;
    raises `LocalRunError` where the launch fails or outlasts ``timeout_s``."""
    plan = finalist.plan
    gpus = runs_on_gpus(plan)
    if gpus:  # this process's cached blocks on GPU 0 would be rank 0's memory less
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="autopart-finalist-") as folder:
        work = Path(folder)
        out = emit_directory(plan, finalist.front.op_graph, finalist.front.spec, work / "out",
                             chain=finalist.front.chain)
        metrics = work / "metrics.jsonl"
        timed = timed_run(MEASURED_SECONDS, warmup=WARMUP_STEPS, least=MEASURED_STEPS, most=MAX_STEPS)
        run_locally(out, plan.world_size, [*timed, "--metrics", str(metrics)], timeout_s=timeout_s, cwd=work, gpus=gpus)
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return statistics.median(record["step_s"] for record in records[WARMUP_STEPS:])


def chosen_by_running(count: int, run: Callable[[int], float],
                      heard: Callable[[int, int], None] | None = None) -> tuple[int, dict[int, list[float]]]:
    """(the index of the fastest of ``count`` finalists, each one's measured steps): each run
    once by ``run(index)`` (infinite for one that could not run), those within `CLOSE` of the
    fastest once more in reverse order, and judged by the median of their runs (ties, and where
    none ran, to the lower index). ``heard(done, total)`` follows the runs, from (0, count)."""
    measured: dict[int, list[float]] = {index: [] for index in range(count)}
    total = count
    if heard is not None:
        heard(0, total)
    for index in range(count):
        measured[index].append(run(index))
        if heard is not None:
            heard(index + 1, total)
    fastest = min(seconds[0] for seconds in measured.values())
    close = [index for index in range(count) if measured[index][0] <= fastest * (1 + CLOSE)]
    if len(close) > 1 and not math.isinf(fastest):  # where none ran, none runs again
        total += len(close)
        for done, index in enumerate(reversed(close), start=count + 1):
            measured[index].append(run(index))
            if heard is not None:
                heard(done, total)
    return _fastest(measured), measured


def _fastest(measured: dict[int, list[float]]) -> int:
    """The finalist of the smallest median of its launches (ties to the lower index)."""
    return min(measured, key=lambda index: (statistics.median(measured[index]), index))


def run_finalists(finalists: tuple[Finalist, ...], *, kind: str | None = None, fresh: bool = False,
                  progress: Callable[[str, int, int], None] | None = None,
                  run: Callable[[Finalist], float] | None = None) -> tuple[Plan, Front]:
    """The fastest of ``finalists`` (the search's, its chosen one first) as run here (by
    ``run``, `finalist_step_s` unless given), its plan's ``provenance.search`` recording each
    finalist's measured step (``measured_step_s``, None with an ``error`` where its launch
    failed) in its row, that plan's row first, and when they ran (``ran_at``). With ``kind``
    (this machine's device, "cpu" or "cuda") what they measured is kept in the cache
    (`autopart.profiling.finalist_cache`) and, unless ``fresh``, read from it where every
    finalist is there (``from_cache``), none launched. One finalist is returned as it is; where
    none ran, the search's choice, and a warning says why."""
    first = finalists[0]
    if len(finalists) < 2:
        return first.plan, first.front
    plans = [finalist.plan for finalist in finalists]
    cached = None if kind is None or fresh else finalist_cache.read_records(plans, kind)
    start = time.perf_counter()
    if cached is not None:
        measured = {index: steps for index, (steps, _) in enumerate(cached)}
        chosen, errors, ran_at = _fastest(measured), {}, cached[0][1]  # one run: one time
    else:
        chosen, measured, errors = _launched(finalists, run or finalist_step_s, progress)
        ran_at = time.time()
        if kind is not None:
            finalist_cache.write_records([(plans[i], measured[i]) for i in measured if i not in errors],
                                         [plans[i] for i in errors], kind)
    if len(errors) == len(finalists):  # then `chosen` is the first, the search's choice
        log.warning(f"none of the search's finalists ran here ({errors[0]}); the plan is the search's choice")
    search = first.plan.provenance.search
    rows = [dict(row) for row in search["ranked"]]
    for index, finalist in enumerate(finalists):
        step = statistics.median(measured[index])
        rows[finalist.row].update(measured_step_s=None if math.isinf(step) else step, launches=len(measured[index]))
        if index in errors:
            rows[finalist.row]["error"] = errors[index]
            log.warning(f"the search's finalist {rows[finalist.row]['layout']} did not run here "
                        f"({errors[index]}); it is left out")
    kept = finalists[chosen].row
    rows = [rows[kept], *(row for i, row in enumerate(rows) if i != kept)]
    search = dict(search, ranked=rows, chosen_by="run" if len(errors) < len(finalists) else "search",
                  run_seconds=round(time.perf_counter() - start, 3), ran_at=round(ran_at), from_cache=cached is not None)
    plan = finalists[chosen].plan
    return replace(plan, provenance=replace(plan.provenance, search=search)), finalists[chosen].front


def _launched(finalists: tuple[Finalist, ...], run: Callable[[Finalist], float],
              progress: Callable[[str, int, int], None] | None) -> tuple[int, dict[int, list[float]], dict[int, str]]:
    """`chosen_by_running` over ``finalists`` launched by ``run``, and the first line of each
    failed launch's error by index."""
    errors: dict[int, str] = {}

    def step_of(index: int) -> float:
        try:
            return run(finalists[index])
        except LocalRunError as error:
            errors[index] = str(error).splitlines()[0]
            return math.inf

    def heard(done: int, total: int) -> None:
        if progress is not None:
            progress("running the finalists here", done, total)

    chosen, measured = chosen_by_running(len(finalists), step_of, heard)
    return chosen, measured, errors
