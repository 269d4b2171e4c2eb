"""How good is the plan autopart's search picks? Its step against five baselines, all judged by
the same simulator on the same costs.

    python benchmarks/plan_quality.py [--cases NAME ...] [--exhaustive-limit N]
    python benchmarks/plan_quality.py --dimensions [--cases NAME ...]   # issue 24's dimensions, one at a time

The costs: each model is captured and annotated by the compiler's own front (``FrontTable``, the
roofline cost model of the cluster's device, fp32 as captured: bf16 is not modelled yet), built
on the meta device with two of its layers; ``autopart.solve.repeat`` then repeats the layers to
the model's full depth (a copy costs what the captured layer costs, block for block). The small
cases at the end use the captured chain as it is, so that exhaustive search can finish.

The score, in two steps as the issue asks ("lower bounds prune the space; the simulator ranks
the finalists"): every method first ranks its candidates by the closed-form estimate
(``autopart.solve.closed_form.estimate_step_s`` through ``score_layout``: the schedule's pipeline latency,
the data-parallel gradient all-reduce and the optimizer step of the busiest rank); then its best
few are simulated (``autopart.solve.simulated.simulated_step_s``: each stage's summed block
costs on the schedule the compiler emits, action by action, then the same all-reduce and
optimizer tail) and the best simulated is its step. For autopart the few are the search's
finalists (``SearchResult.ranked``); for each baseline, its ``--top`` best by estimate
(``BaselineResult.top``). The estimates are printed too, in a second table.

"bound" is the search's lower bound (``SearchResult.bound_s``: the smallest closed-form bound
over every layout of the space, infinite where a layout cannot fit:
``autopart.solve.layout_bounds.may_fit``) over autopart's simulated step. It bounds the
closed form; the simulator can beat a layout's closed-form bound where stages are unequal (1F1B
hides later stages behind the warm-up), so in the simulator's terms it is close to, not
strictly, the best any plan could do. megatron / bound in the summary is then about the most any
plan could gain over Megatron's grid under this cost model.

The methods (``autopart.solve.baselines`` and ``autopart.solve.baseline_search``):
- autopart: ``autopart.solve.search.search`` over its whole space (pp x tp x dp, micro-batch size,
  gpipe / 1f1b / interleaved / zb-h1 / zbv, ZeRO levels 0-3, recompute per stage; sequence
  parallelism with TP).
- uniform, parameters: DeepSpeed's partition methods; pipedream: PipeDream's dynamic program
  (SOSP'19); megatron: equal layers per stage. Each on Megatron's grid: every (t, p, d) with t
  inside a node, every micro-batch size, 1F1B, with or without the distributed optimizer
  (ZeRO-1) or Megatron-FSDP (ZeRO-2 and 3), sequence parallelism with TP as autopart has it, one
  recompute setting for all stages.
- exhaustive: every layout of autopart's space x every cut set x every recompute mode per
  stage, where that is at most ``--exhaustive-limit`` candidates ("-" where it is more).

Prints the simulated table (step seconds of autopart, each baseline's step as a multiple of
autopart's: above 1.00x, autopart is faster; the bound), the same by estimate, the layouts
chosen, then a summary line for each.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autopart.driver import CompileOptions  # noqa: E402
from autopart.solve.planner import FrontTable, cluster_of, search_space  # noqa: E402
from autopart.solve.search import Scored, search  # noqa: E402
from autopart.solve.baseline_search import PARTITIONERS, exhaustive_search, grid_search  # noqa: E402
from autopart.solve.baselines import block_layers  # noqa: E402
from autopart.solve.repeat import RepeatedTable, repeat_last  # noqa: E402
from autopart.solve.simulated import simulated_step_s  # noqa: E402
from autopart.schedule import SCHEDULE_KINDS  # noqa: E402

MODELS = REPO / "benchmarks" / "models"
BASELINES = ("uniform", "parameters", "pipedream", "megatron", "exhaustive")


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    model: str  # a file of benchmarks/models
    device: str
    world_size: int
    global_batch_size: int
    gpus_per_node: int = 8
    pattern: tuple[int, ...] | None = None  # captured layer per layer of the full model; None: as captured
    dtype: str | None = None  # None: fp32
    tags: tuple[str, ...] = field(default=())


CASES = (
    Case(name="GPT-3 1.3B", model="gpt3_1p3b", device="a100-80gb", world_size=8, global_batch_size=512,
         pattern=repeat_last(2, 24)),
    Case(name="GPT-3 1.3B", model="gpt3_1p3b", device="h100-sxm", world_size=64, global_batch_size=512,
         pattern=repeat_last(2, 24)),
    Case(name="GPT-3 13B", model="gpt3_13b", device="a100-80gb", world_size=64, global_batch_size=1024,
         pattern=repeat_last(2, 40)),
    Case(name="GPT-3 13B", model="gpt3_13b", device="h100-sxm", world_size=256, global_batch_size=1024,
         pattern=repeat_last(2, 40)),
    Case(name="GPT-3 175B", model="gpt3_175b", device="a100-80gb", world_size=1024, global_batch_size=1536,
         pattern=repeat_last(2, 96)),
    Case(name="GPT-3 175B", model="gpt3_175b", device="h100-sxm", world_size=512, global_batch_size=1536,
         pattern=repeat_last(2, 96)),
    Case(name="Llama 8B, 128k vocab", model="llama3_8b", device="h100-sxm", world_size=64, global_batch_size=512,
         pattern=repeat_last(2, 32), tags=("large-vocab",)),
    Case(name="Llama 8B, 128k vocab", model="llama3_8b", device="a100-80gb", world_size=128, global_batch_size=512,
         pattern=repeat_last(2, 32), tags=("large-vocab",)),
    Case(name="mixed width 16B, 8+24", model="mixed_width", device="a100-80gb", world_size=32, global_batch_size=256,
         pattern=(0,) * 8 + (1,) * 24, tags=("heterogeneous",)),
    Case(name="mixed width 16B, 8+24", model="mixed_width", device="h100-sxm", world_size=256, global_batch_size=512,
         pattern=(0,) * 8 + (1,) * 24, tags=("heterogeneous",)),
    Case(name="mixed width 58B, 8+40", model="mixed_width_58b", device="a100-80gb", world_size=256,
         global_batch_size=1024, pattern=(0,) * 8 + (1,) * 40, tags=("heterogeneous",)),
    Case(name="mixed width 58B, 8+40", model="mixed_width_58b", device="h100-sxm", world_size=512,
         global_batch_size=1024, pattern=(0,) * 8 + (1,) * 40, tags=("heterogeneous",)),
    Case(name="GPT-3 175B, 2 layers", model="gpt3_175b", device="a100-40gb", world_size=4, global_batch_size=8,
         gpus_per_node=1, tags=("small",)),
    Case(name="GPT-3 13B, 2 layers", model="gpt3_13b", device="a100-80gb", world_size=4, global_batch_size=32,
         gpus_per_node=2, tags=("small",)),
    Case(name="mixed width, 2 layers", model="mixed_width", device="a100-40gb", world_size=4, global_batch_size=16,
         gpus_per_node=1, tags=("small",)),
)


DIMENSION_CASES = (
    Case(name="Llama 3 70B, s 8k", model="llama3_70b_s8192", device="h100-sxm", world_size=256,
         global_batch_size=512, pattern=repeat_last(2, 80), dtype="bf16"),
    Case(name="Llama 3 70B, s 32k", model="llama3_70b_s32768", device="h100-sxm", world_size=512,
         global_batch_size=128, pattern=repeat_last(2, 80), dtype="bf16"),
    Case(name="Llama 3 405B, s 8k", model="llama3_405b_s8192", device="h100-sxm", world_size=2048,
         global_batch_size=2048, pattern=repeat_last(2, 126), dtype="bf16"),
)
"""Llama 3 shapes (grouped-query attention) on H100s in bf16 (autocast, fp32 weights and
gradients), 4M and 16M tokens a step: where sequence
parallelism, ZeRO's levels, ZB-V and the overlapped reduction may matter (``--dimensions``)."""

VARIANTS = {
    "searched": {},
    "no SP": {"options": {"sp": False}},
    "ZeRO 1 fixed": {"space": {"zero": (1,)}},
    "ZeRO 3 fixed": {"space": {"zero": (3,)}},
    "no zbv": {"space": {"schedule": tuple(k for k in SCHEDULE_KINDS if k != "zbv")}},
    "all-reduce not overlapped": {"cluster": {"reduction_overlaps": False}},
}
"""Each of issue 24's dimensions taken away from the search in turn (ZeRO: only level 1 where
there are replicas, as before it, or only level 3, to show what it costs where it is not chosen;
the overlap: the whole all-reduce after the pipeline)."""


def dimension_effects(case: Case) -> list[tuple[str, Scored | None, float]]:
    """Per variant: the best of the search's finalists by simulation, and the search's seconds."""
    found = []
    tables = {}
    for name, changes in VARIANTS.items():
        options = dataclasses.replace(_case_options(case), **changes.get("options", {}))
        if options.sp not in tables:  # one capture per sequence-parallel setting
            tables[options.sp] = _case_table(case, options)[0]
        table = tables[options.sp]
        space = dataclasses.replace(search_space(options), **changes.get("space", {}))
        cluster = dataclasses.replace(cluster_of(options), **changes.get("cluster", {}))
        start = time.perf_counter()
        result = search(space, table, cluster)
        found.append((name, _best_simulated(result.ranked, table, cluster), time.perf_counter() - start))
    return found


def dimensions_table(case: Case, rows: list[tuple[str, Scored | None, float]]) -> Table:
    table = Table(title=f"{case.name} on {case.world_size} x {case.device}, batch {case.global_batch_size}: "
                        "the searched plan with each dimension taken away (simulated step, the search's peak memory)")
    for column in ("variant", "step s", "vs searched", "peak GiB", "layout (recompute)", "search s"):
        table.add_column(column, justify="left" if column in ("variant", "layout (recompute)") else "right")
    base = _step(rows[0][1], simulated=True)
    for name, scored, seconds in rows:
        if scored is None:
            table.add_row(name, "no fit", "-", "-", "-", f"{seconds:.1f}")
            continue
        table.add_row(name, f"{scored.step_s:.3f}", f"{scored.step_s / base:.3f}x",
                      f"{scored.peak_memory_bytes / (1 << 30):.1f}", _describe(scored), f"{seconds:.1f}")
    return table


@dataclass(frozen=True, kw_only=True)
class Outcome:
    case: Case
    autopart: Scored | None  # the best finalist by simulation (its step_s simulated)
    estimated: Scored | None  # the best by estimate (the search's own ranking)
    bound_s: float  # the search's lower bound over the whole space
    baselines: dict  # name -> BaselineResult (ranked by estimate)
    simulated: dict  # name -> Scored | None: the best of its top few by simulation (step_s simulated)
    search_s: float
    front_s: float
    simulate_s: float  # simulating every method's few


def _case_options(case: Case) -> CompileOptions:
    return CompileOptions(model=MODELS / f"{case.model}.py", world_size=case.world_size, device=case.device,
                          global_batch_size=case.global_batch_size, gpus_per_node=case.gpus_per_node,
                          dtype=case.dtype)


def _case_table(case: Case, options: CompileOptions):
    """The case's cost table (its shallow capture repeated to full depth where it has a pattern)
    and its layer per block."""
    front = FrontTable(options)

    def layers_of(micro_batch_size: int, tp: int, dtype: str):
        return block_layers(front.front(micro_batch_size=micro_batch_size, tp=tp, dtype=dtype).chain)

    table = front if case.pattern is None else RepeatedTable(inner=front, layers_of=layers_of, pattern=case.pattern)
    table_layers = layers_of if case.pattern is None else (
        lambda b, t, d: table.block_layers(micro_batch_size=b, tp=t, dtype=d))
    return table, table_layers


def run_case(case: Case, *, exhaustive_limit: int, top: int) -> Outcome:
    options = _case_options(case)
    table, table_layers = _case_table(case, options)
    space = search_space(options)
    cluster = cluster_of(options)
    start = time.perf_counter()
    for layout in space.layouts(1 << 30):  # the front, captured for every (micro-batch size, tp) first
        table.chain_costs(micro_batch_size=layout.micro_batch_size, tp=layout.tp, dtype=layout.dtype)
    front_s = time.perf_counter() - start
    start = time.perf_counter()
    result = search(space, table, cluster)
    search_s = time.perf_counter() - start
    baselines = {name: grid_search(name, space, table, cluster, partition, table_layers, top=top)
                 for name, partition in PARTITIONERS.items()}
    baselines["exhaustive"] = exhaustive_search(space, table, cluster, limit=exhaustive_limit, top=top)
    start = time.perf_counter()
    ours = _best_simulated(result.ranked, table, cluster)
    simulated = {name: _best_simulated(r.top, table, cluster) for name, r in baselines.items()}
    simulate_s = time.perf_counter() - start
    return Outcome(case=case, autopart=ours, estimated=result.best if result.ranked else None,
                   bound_s=result.bound_s, baselines=baselines, simulated=simulated, search_s=search_s,
                   front_s=front_s, simulate_s=simulate_s)


def _best_simulated(candidates, table, cluster) -> Scored | None:
    """The candidate with the shortest simulated step (ties: the better estimate), step_s set."""
    found = [dataclasses.replace(s, step_s=simulated_step_s(s, table, cluster)) for s in candidates]
    return min(found, key=lambda s: (s.step_s, s.estimate_s, s.layout), default=None)


def _step(scored: Scored | None, *, simulated: bool) -> float:
    if scored is None:
        return math.inf
    return scored.step_s if simulated else scored.estimate_s


def _describe(scored) -> str:
    if scored is None:
        return "-"
    modes = sorted(set(scored.recompute))
    return f"{scored.layout.describe()} ({'/'.join(modes)})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", help="run only the cases whose names contain one of these")
    # four recompute modes per stage: the two-layer cases' every layout, cut set and modes
    parser.add_argument("--exhaustive-limit", type=int, default=3_000_000,
                        help="most candidates exhaustive search scores (default 3,000,000)")
    parser.add_argument("--top", type=int, default=5,
                        help="each baseline's best candidates by estimate that are simulated (default 5)")
    parser.add_argument("--dimensions", action="store_true",
                        help="instead: the Llama 3 cases, searched with each of issue 24's dimensions taken away")
    args = parser.parse_args(argv)
    console = Console(width=200)
    if args.dimensions:
        for case in DIMENSION_CASES:
            if not args.cases or any(w.lower() in case.name.lower() for w in args.cases):
                console.print(dimensions_table(case, dimension_effects(case)))
        return
    cases = [c for c in CASES if not args.cases or any(w.lower() in c.name.lower() for w in args.cases)]
    outcomes = []
    for case in cases:
        console.print(f"[dim]{case.name} on {case.world_size} x {case.device}, batch {case.global_batch_size} ...[/dim]")
        outcomes.append(run_case(case, exhaustive_limit=args.exhaustive_limit, top=args.top))
    console.print(_steps_table(outcomes, simulated=True))
    console.print(_steps_table(outcomes, simulated=False))

    layouts = Table(title="Chosen layouts, by simulation (recompute modes used)")
    for column in ("case", "GPUs", "autopart", "megatron", "exhaustive"):
        layouts.add_column(column)
    for o in outcomes:
        layouts.add_row(o.case.name, str(o.case.world_size), _describe(o.autopart),
                        _describe(o.simulated["megatron"]), _describe(o.simulated["exhaustive"]))
    console.print(layouts)
    console.print(summary(outcomes, simulated=True))
    console.print(summary(outcomes, simulated=False))


def _steps_table(outcomes: list[Outcome], *, simulated: bool) -> Table:
    if simulated:
        title = ("Simulated step: autopart, each baseline as a multiple of it, and the search's lower bound over it "
                 "(each method's best few by estimate, simulated)")
    else:
        title = "Estimated step (closed form): autopart, and each baseline as a multiple of it"
    columns = ("case", "GPUs", "device", "batch", "autopart s", *BASELINES,
               *(("bound", "search s", "simulate s") if simulated else ("search s",)))
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in ("case", "device") else "right")
    for o in outcomes:
        ours = _step(o.autopart if simulated else o.estimated, simulated=simulated)
        cells = []
        for name in BASELINES:
            result = o.baselines[name]
            if not result.finished:
                cells.append("-")
            elif result.best is None:
                cells.append("no fit")
            else:
                theirs = _step(o.simulated[name], simulated=True) if simulated else result.step_s
                cells.append(f"{theirs / ours:.3f}x")
        extra = ((f"{o.bound_s / ours:.3f}x", f"{o.search_s:.2f}", f"{o.simulate_s:.2f}") if simulated
                 else (f"{o.search_s:.2f}",))
        table.add_row(o.case.name, str(o.case.world_size), o.case.device, str(o.case.global_batch_size),
                      f"{ours:.3f}", *cells, *extra)
    return table


def summary(outcomes: list[Outcome], *, simulated: bool = True) -> str:
    tolerance = 1e-9
    wins = exact = finished = 0
    losses = []

    def step_of(o: Outcome, name: str) -> float:
        return _step(o.simulated[name], simulated=True) if simulated else o.baselines[name].step_s

    for o in outcomes:
        ours = _step(o.autopart if simulated else o.estimated, simulated=simulated)
        others = [step_of(o, n) for n, r in o.baselines.items() if r.finished and n != "exhaustive"]
        if all(ours <= s * (1 + tolerance) for s in others):
            wins += 1
        else:
            losses.append(f"{o.case.name} on {o.case.world_size}")
        if o.baselines["exhaustive"].finished:
            finished += 1
            theirs = step_of(o, "exhaustive")
            exact += ours <= theirs * (1 + tolerance) if simulated else abs(ours - theirs) <= tolerance * theirs
    targeted = [o for o in outcomes if {"large-vocab", "heterogeneous"} & set(o.case.tags) and o.autopart is not None]
    if simulated:
        speedups = ", ".join(
            f"{o.case.name} on {o.case.world_size} {step_of(o, 'megatron') / o.autopart.step_s:.2f}x "
            f"(bound {step_of(o, 'megatron') / o.bound_s:.2f}x)" for o in targeted)
    else:
        speedups = ", ".join(f"{o.case.name} on {o.case.world_size} {step_of(o, 'megatron') / o.estimated.estimate_s:.2f}x"
                             for o in targeted)
    ratio = "megatron / autopart (megatron / bound)" if simulated else "megatron / autopart"
    target = f"; {ratio} on the large-vocab and heterogeneous cases: {speedups}" if speedups else ""
    lost = f" (loses on {', '.join(losses)})" if losses else ""
    against = ("<= exhaustive's best simulated finalist" if simulated else "equal to exhaustive")
    judge = "By simulation" if simulated else "By estimate"
    return (f"{judge}: autopart <= every baseline in {wins}/{len(outcomes)} cases{lost}; {against} in "
            f"{exact}/{finished} cases where it finished{target}")


if __name__ == "__main__":
    main()
