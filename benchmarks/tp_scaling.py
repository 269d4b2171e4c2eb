"""Where tensor parallelism stops paying: the predicted step time of one GPT-3-size layer
(h = 12288, 96 heads, s = 2048, microbatch 1, bf16 unless ``--dtype fp32``) on h100-sxm nodes
of 8 GPUs, for TP degrees 1 to 16. Beyond 8 the TP group crosses nodes and its all-reduces run
over InfiniBand instead of NVLink.

    python benchmarks/tp_scaling.py [--degrees 1 2 4 8 16] [--gpus-per-node 8] [--dtype bf16]

The model is built on the meta device, so nothing is allocated; the CP-SAT sharding solver picks
every op's split by itself at each degree. Prints a table: degree, layer time (forward +
backward of the layer block), its compute and communication parts, speed-up over t = 1, and the
parallel efficiency.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autopart.driver import CompileOptions
from autopart.passes.front import build_front  # noqa: E402
from autopart.solve.baselines import block_layers  # noqa: E402

MODEL = REPO / "benchmarks" / "models" / "gpt3_layer.py"


def layer_time(tp: int, gpus_per_node: int, dtype: str) -> tuple[float, float, float]:
    """(total, compute, communication) seconds of the transformer layer's blocks on one rank."""
    options = CompileOptions(model=MODEL, tp=tp, microbatches=1, micro_batch_size=1, device="h100-sxm",
                             gpus_per_node=gpus_per_node, dtype=dtype)  # fmt: skip
    front = build_front(options, 1)
    in_layer = [k for k, layer in enumerate(block_layers(front.chain)) if layer is not None]
    if front.shardings is None:
        compute = sum(front.chain.blocks[k].forward_s + front.chain.blocks[k].backward_s for k in in_layer)
        return compute, compute, 0.0
    compute = sum(front.shardings[k].compute_s for k in in_layer)
    communication = sum(front.shardings[k].communication_s for k in in_layer)
    return compute + communication, compute, communication


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()
    table = Table(title=f"GPT-3 layer on h100-sxm, {args.gpus_per_node} GPUs per node, microbatch 1 x 2048 tokens, "
                        f"{args.dtype}")
    for column in ("tp", "links", "layer ms", "compute ms", "comm ms", "speed-up", "efficiency"):
        table.add_column(column, justify="right")
    base = None
    for tp in args.degrees:
        total, compute, communication = layer_time(tp, args.gpus_per_node, args.dtype)
        if base is None:  # the first degree (1 by default) is the reference
            base = total * tp
        speedup = base / total
        table.add_row(
            str(tp), "InfiniBand" if tp > args.gpus_per_node else "NVLink", f"{total * 1e3:.2f}",
            f"{compute * 1e3:.2f}", f"{communication * 1e3:.2f}", f"{speedup:.2f}x", f"{speedup / tp:.0%}",
        )  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
