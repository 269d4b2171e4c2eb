"""The data-parallel all-reduce overlapped with the backward, on this CPU: the step model's tail
(`autopart.predict.reduction`) against the runtime's, as ``train.py --action-times`` measures it.

    python benchmarks/dp_overlap.py [--steps 12] [--warmup 3] [--rows dp2,pp2xdp2,pp2xdp2-zb]

For each row it compiles ``benchmarks/models/wide_gpt.py`` (4 MB of weights: per stage a first
bucket of 1 MiB and the rest) for the ``cpu`` device, trains it under torchrun with
``--action-times``, and per pipeline rank prints
- ``wait``: from the end of the rank's last compute action to the end of its wait for the
  reductions (``reduced`` in the action times), median over the steps after the warm-up and over
  the data-parallel replicas; predicted: ``plan.predicted.reduction_s[rank][1]``;
- ``delay``: how much longer the compute action during which the reductions were launched took
  than the same stage's other actions of its kind in the step (median of the difference): the
  reductions' work on the cores shared with it; predicted: ``reduction_s[rank][0]``;
- ``launched``: the first bucket's launch, seconds before the end of the rank's last compute.
Run ``autopart profile-comm`` first: the share of a message's time spent on the cores comes
from its ``p2p_send_cpu`` and ``p2p_recv_cpu``. Other work on the machine slows what is
measured and none of what is predicted; the 1-minute load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autopart.driver import CompileOptions, compile_to_directory  # noqa: E402
from autopart.tools.local_run import run_locally  # noqa: E402
from autopart.runtime.mesh import Mesh  # noqa: E402
from autopart.schedule import Action  # noqa: E402

MODEL = REPO / "benchmarks" / "models" / "wide_gpt.py"
ROWS = {"dp2": (1, "1f1b"), "pp2xdp2": (2, "1f1b"), "pp2xdp2-zb": (2, "zb-h1")}


def _measured(folder: Path, plan, warmup: int) -> dict[int, dict[str, list[float]]]:
    """Per pipeline rank, each step's wait, delay and first launch (seconds)."""
    mesh = Mesh.of(plan)
    found: dict[int, dict[str, list[float]]] = {}
    for file in folder.glob("rank_*.jsonl"):
        pp = mesh.coordinates(int(file.stem.split("_")[1])).pp
        mine = found.setdefault(pp, {"wait": [], "delay": [], "launched": []})
        for line in file.read_text().splitlines():
            record = json.loads(line)
            if record["step"] < warmup:
                continue
            compute = [(Action.parse(n), s, e) for n, s, e, _ in record["actions"] if Action.parse(n).is_compute]
            last_end = max(e for _, _, e in compute)
            mine["wait"].append(record["reduced"] - last_end)
            if record["buckets"]:
                mine["launched"].append(last_end - record["buckets"][0])
                during = [(a, s, e) for a, s, e in compute if s <= record["buckets"][0] <= e]
                if during:  # the action the first bucket left from, against its stage's others of that kind
                    action, start, end = during[0]
                    others = [e - s for a, s, e in compute if a.stage == action.stage and a.kind is action.kind
                              and a != action]
                    if others:
                        mine["delay"].append(end - start - statistics.median(others))
    return found


def _row(name: str, steps: int, warmup: int, folder: Path) -> list[str]:
    pp, schedule = ROWS[name]
    out = folder / name
    plan, _ = compile_to_directory(
        CompileOptions(model=MODEL, pp=pp, dp=2, microbatches=2 * pp, micro_batch_size=2,
                       global_batch_size=8 * pp, schedule=schedule), out)  # fmt: skip
    times = folder / f"{name}-times"
    metrics = folder / f"{name}-metrics.jsonl"
    run_locally(out, plan.world_size, ["--steps", str(steps), "--action-times", str(times), "--metrics", str(metrics)],
                timeout_s=900, cwd=folder)
    step_s = statistics.median(json.loads(line)["step_s"] for line in metrics.read_text().splitlines()[warmup:])
    measured = _measured(times, plan, warmup)
    lines = []
    for rank in range(pp):
        delay, wait = plan.predicted.reduction_s[rank]
        got = {k: statistics.median(v) if v else float("nan") for k, v in measured[rank].items()}
        lines.append(f"| {name} | {rank} | {wait * 1e3:.2f} | {got['wait'] * 1e3:.2f} | {delay * 1e3:.2f} | "
                     f"{got['delay'] * 1e3:.2f} | {got['launched'] * 1e3:.2f} | {plan.predicted.step_s * 1e3:.1f} | "
                     f"{step_s * 1e3:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", default=",".join(ROWS))
    args = parser.parse_args()
    print(f"load average (1 min): {os.getloadavg()[0]:.1f}")
    print("| row | pp rank | wait predicted ms | wait measured ms | delay predicted ms | delay measured ms "
          "| first bucket before the end ms | step predicted ms | step measured ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.rows.split(","):
            for line in _row(name, args.steps, args.warmup, Path(folder)):
                print(line, flush=True)


if __name__ == "__main__":
    main()
