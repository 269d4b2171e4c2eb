"""Where the plan search's time goes: CPU seconds of ``plan_by_search`` by part, in this process.

    python benchmarks/search_parts.py MODEL.py WORLD_SIZE GLOBAL_BATCH DTYPE [--search-only]

CPU seconds (``time.process_time``, every thread of the process) rather than a wall clock or
cProfile: on a shared machine the wall clock measures the other sessions too, and cProfile's
per-call overhead inflates the parts made of many small calls (the cutter) several times over.
``--search-only`` runs the search over the shallow copy and the simulated finalists without the
full model's plan (whose capture at full depth dominates a 1,024-layer compile).
Results go in docs/solver_scale.md.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from pathlib import Path

from autopart.options import CompileOptions
from autopart.solve import front_table, planner, search
from autopart.solve.simulated import simulated_step_s

PARTS = ((search, "cut_stages", "cutter"), (search, "refine_cuts", "refining cuts"), (front_table, "annotated", "annotation"),
         (front_table, "sharded", "sharding"), (planner, "simulated_step_s", "simulating finalists"))


def timed(spent: collections.Counter, calls: collections.Counter) -> None:
    """Wrap each part so that its CPU seconds and calls add up in ``spent`` and ``calls``."""
    for module, name, label in PARTS:
        original = getattr(module, name)

        @functools.wraps(original)
        def wrapper(*args, _original=original, _label=label, **kwargs):
            start = time.process_time()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_label] += time.process_time() - start
                calls[_label] += 1

        setattr(module, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("world_size", type=int)
    parser.add_argument("global_batch_size", type=int)
    parser.add_argument("dtype")
    parser.add_argument("--search-only", action="store_true")
    args = parser.parse_args()
    options = CompileOptions(model=args.model, world_size=args.world_size, gpus_per_node=8, device="a100-80gb",
                             global_batch_size=args.global_batch_size, dtype=args.dtype)
    spent, calls = collections.Counter(), collections.Counter()
    timed(spent, calls)
    cpu, wall = time.process_time(), time.perf_counter()
    if args.search_only:
        table = planner.shallow_table(planner.FrontTable(options))
        if table is None:
            raise SystemExit(f"{args.model} has no long run of identical layers to search through: drop --search-only")
        cluster = planner.cluster_of(options)
        result = search.search(planner.search_space(options), table, cluster,
                               score=lambda scored: simulated_step_s(scored, table, cluster))
        best, step_s = result.best.layout.describe(), result.best.step_s
    else:
        searched = planner.plan_by_search(options)
        result, step_s = searched.result, searched.plan.predicted.step_s
        best = searched.result.best.layout.describe()
    print(f"CPU {time.process_time() - cpu:.2f} s, wall {time.perf_counter() - wall:.2f} s; "
          f"{result.layouts} layouts, {result.scored} scored; best {best}, {step_s * 1e3:.3f} ms a step")
    for label, seconds in spent.most_common():
        print(f"  {label:22s} {seconds:8.2f} CPU s  {calls[label]:6d} calls")


if __name__ == "__main__":
    main()
