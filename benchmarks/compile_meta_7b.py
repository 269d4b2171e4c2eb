"""Compile a 6.7B-parameter Llama built on the meta device into a plan for 16 H100s, and report
the compile's wall time and peak memory: the model's weights (27 GB in fp32) are never allocated.

    python benchmarks/compile_meta_7b.py [--out OUT] [--time-limit S]

Prints the stage table, then one line: ``compile wall S s, peak memory G GiB (max RSS)``. On a
2-core machine the front passes (capture, fake-tensor annotation of ~2,900 nodes) take about a
minute and CP-SAT needs a longer limit than its default to find its first plan for 263 blocks
on 16 stages, hence ``--time-limit 120``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autopart.tools.cli import main, peak_memory_gib  # noqa: E402


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="output directory (default: a temporary one, removed)")
    parser.add_argument("--time-limit", type=float, default=120.0, help="CP-SAT seconds (default 120)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="autopart-7b-")) / "out"
    start = time.perf_counter()
    try:
        main([
            "compile", str(REPO / "examples" / "llama_7b.py"), "-o", str(out),
            "--device", "h100-sxm", "--pp", "16", "--microbatches", "32", "--global-batch-size", "32",
            "--time-limit", str(args.time_limit),
        ])  # fmt: skip
    finally:
        wall = time.perf_counter() - start
        print(f"compile wall {wall:.0f} s, peak memory {peak_memory_gib():.2f} GiB (max RSS)")
        if args.out is None:
            shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    run()
