"""How much the in-place op profile moves between runs: its level against each op's share.

    python benchmarks/in_place_shares.py [--model examples/gpt.py] [--spans 5,1.5] [--repeats 3]

Times every op of the model in place (`autopart.profiling.in_situ.time_in_situ`, one thread, as
a rank runs) ``--repeats`` times at each span, interleaved, and prints per span the whole
forward and backward those profiles sum to (the level) and how far apart two profiles put the
ops' shares: the largest gap between their cumulative shares over the graph's order, which is
what moves a pipeline's cuts. Where the compile runs the plan's pipeline next, that run sets each
stage's level and the profile gives only the shares (`SHARES_SECONDS`).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autopart.ir.model_file import load_model_file  # noqa: E402
from autopart.passes.capture import capture, graph_args  # noqa: E402
from autopart.profiling.in_situ import time_in_situ  # noqa: E402
from autopart.profiling.profile import made_to_time  # noqa: E402


def cumulative_shares(profile: dict) -> tuple[float, list[float]]:
    """The profile's whole forward and backward, and each op's cumulative share of it."""
    seconds = [times.forward_s + times.backward_s for times in profile.values()]
    total = sum(seconds)
    return total, [sum(seconds[: i + 1]) / total for i in range(len(seconds))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "examples" / "gpt.py")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--spans", default="5,1.5", help="seconds each profile spans, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="profiles per span (default 3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = load_model_file(args.model)
    graph = capture(spec, batch_size=args.micro_batch_size)
    module = made_to_time(graph.module, spec)
    inputs, target = spec.example(args.micro_batch_size)
    values = graph_args(graph, inputs, target)
    spans = [float(s) for s in args.spans.split(",")]
    profiles: dict[float, list[tuple[float, list[float]]]] = {s: [] for s in spans}
    for _ in range(args.repeats):
        for seconds in spans:  # interleaved: each span sees the machine's moods alike
            start = time.perf_counter()
            profiles[seconds].append(cumulative_shares(time_in_situ(module, values, min_seconds=seconds)))
            print(f"  {seconds:g} s profile took {time.perf_counter() - start:.1f} s", file=sys.stderr)
    table = Table(title=f"{args.model.name} in place, micro-batch {args.micro_batch_size}, "
                        f"{args.repeats} profiles per span")
    for column in ("span s", "level ms (each profile)", "level spread", "largest share gap"):
        table.add_column(column, justify="right")
    for seconds, runs in profiles.items():
        levels = [level for level, _ in runs]
        gap = max(max(abs(a - b) for a, b in zip(one, two)) for (_, one), (_, two) in itertools.combinations(runs, 2))
        table.add_row(f"{seconds:g}", " ".join(f"{level * 1e3:.2f}" for level in levels),
                      f"{(max(levels) - min(levels)) / min(levels):.1%}", f"{gap:.2%}")
    Console().print(table)


if __name__ == "__main__":
    main()
