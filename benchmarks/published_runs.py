"""autopart's predicted step against published large-model training runs, layout pinned.

    python benchmarks/published_runs.py [--rows NAME ...] [--search]

Each row is a public bf16 run on NVIDIA GPUs that autopart can express: the published layout is
pinned (TP, PP, DP, ZeRO-1 as the distributed optimizer, schedule and chunks, micro-batch,
recompute, sequence parallelism or not and its overlap, the framework's stage split as ``stage_layers``), the
model is built on the meta device at full depth with the attention its software ran (written out
with Megatron's dropouts before FlashAttention, fused after), and ``autopart.compile`` gives
the predicted step (roofline of the named device, bf16 under CUDA autocast) and the MFU it
implies (model FLOPs 72·B·L·s·h²·(1 + s/(6h) + V/(12·h·L)), Narayanan et al.'s count, against
the datasheet peak). Error is predicted over published, less one.

With ``--search`` the same cluster and batch are handed to the search (``--world-size``), and the
searched plan's predicted step is shown beside the pinned one: it must be no slower.

Sources (the research notes behind each row are in docs/published_runs.md):
- BigScience BLOOM-176B, ``bigscience/train/tr11-176B-ml/README.md``: 104.70 s per iteration.
- Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", §2.4:
  60.1 / 50.2 / 44.4 s on 2240 / 2800 / 3360 A100-80GB.
- Jiang et al. 2024, "MegaScale" (arXiv 2402.15627), Table 2, the Megatron-LM baseline rows of
  the 175B model: iteration time at batch 768 and 6144.
- NVIDIA dgxc-benchmarking, ``nemo_megatron/README_175b.md``, the table "NeMo Megatron BF16
  (TP=4,PP=8, MBS=1, VP=12, SEQ=2048)": 8.309 / 8.408 / 8.42 / 8.453 / 8.49 s per step on 128 /
  256 / 512 / 1024 / 2048 H100s at global batch 256 / 512 / 1024 / 2048 / 4096; the recipe's
  ``gpt3_175b_hydra.yaml``: sequence parallelism on, no activation recompute, distributed_fused_adam,
  ``ub_tp_comm_overlap`` (pinned as ``--tp-overlap``).
- MosaicML llm-foundry, ``scripts/train/benchmarking/README.md``, "H100 80GB BF16 (Large Scale,
  >= 128 GPUs)": MPT 7B / 13B / 30B / 70B on 128 / 256 / 512 H100s, PyTorch FSDP FULL_SHARD (ZeRO-3
  over every GPU), amp_bf16 with FSDP's DEFAULT mixed precision (bf16 gathers, fp32
  reduce-scatters), activation checkpointing of every block on 13B-70B; the step is the table's
  GlobalBatchSize (T) over its Throughput (T/s). The models: ``scripts/train/yamls/pretrain/mpt-*.yaml``.
Held out on purpose, as an independent check: Table 1 of Narayanan et al. (SC21) and Tables 4-5 of
Korthikanti et al. (MLSys'23); no row here comes from them or from tables that copy them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import autopart  # noqa: E402
from autopart.predict.accuracy import FULLY_SHARDED, ROOFLINE, Band, band_key, layout_of, write_band  # noqa: E402
from cost_models import get_cost_model  # noqa: E402

MODELS = REPO / "benchmarks" / "models"


@dataclass(frozen=True, kw_only=True)
class Model:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int = 2048
    attention: str = "fused"  # "explicit": scores, softmax and dropout written out (Megatron before FlashAttention)
    dropout: float = 0.0  # Megatron's attention and hidden dropout, with explicit attention

    def flops(self, batch: int) -> float:
        """Model FLOPs of one step (forward and backward, no recompute): Narayanan et al.'s count."""
        L, h, s, V = self.layers, self.hidden, self.seq, self.vocab
        return 72 * batch * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))

    def file(self, folder: Path) -> Path:
        path = folder / f"gpt_{self.layers}x{self.hidden}_{self.heads}h_v{self.vocab}_{self.attention}{self.dropout:g}.py"
        path.write_text(
            f"import sys\nsys.path.insert(0, {str(MODELS)!r})\nfrom shallow import gpt3\n"
            f"MODEL = gpt3(n_embd={self.hidden}, n_head={self.heads}, layers={self.layers}, seq_len={self.seq}, "
            f"vocab_size={self.vocab}, attention={self.attention!r}, dropout={self.dropout})\n"
            "build_model, init_weights, example_batch, loss_fn = MODEL.build_model, MODEL.init_weights, "
            "MODEL.example_batch, MODEL.loss_fn\n"
        )
        return path


@dataclass(frozen=True, kw_only=True)
class Run:
    name: str
    source: str
    model: Model
    device: str
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    recompute: str
    schedule: str
    chunks: int
    published_s: float
    stage_layers: tuple[int, ...] | None = None  # the framework's split, pinned (None: autopart's cuts)
    zero: int = 1  # 1: the distributed optimizer (ZeRO-1); 3: FSDP's FULL_SHARD, a unit per layer
    sp: bool = True  # sequence parallelism with TP
    tp_overlap: bool = False  # the TP collectives overlapped with their linears (--tp-overlap)
    assumed: str = ""  # what the source does not state and the row assumes

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


# 2021-22 runs on Megatron-DeepSpeed: attention written out with the fused scale-mask-softmax, and
# Megatron's dropouts (0.1 attention, 0.1 hidden) on
BLOOM = Model(layers=70, hidden=14336, heads=112, vocab=250880, attention="explicit", dropout=0.1)
MT_NLG = Model(layers=105, hidden=20480, heads=128, vocab=51200, attention="explicit", dropout=0.1)
MEGASCALE_175B = Model(layers=96, hidden=12288, heads=128, vocab=64000)
GPT3_175B = Model(layers=96, hidden=12288, heads=96, vocab=51200)

_MEGASCALE = dict(source="MegaScale Table 2 (Megatron-LM)", model=MEGASCALE_175B, device="a100-80gb", tp=8, pp=8,
                  micro_batch_size=1, recompute="selective", schedule="interleaved", chunks=6,
                  stage_layers=(2,) * 48,  # Megatron-LM's interleaved split: 96 layers, 2 per model chunk
                  assumed="micro-batch 1, selective recompute, 80 GB, FlashAttention, no dropout, sequence parallelism")  # fmt: skip
_MT_NLG = dict(source="MT-NLG (Smith et al. 2022) §2.4", model=MT_NLG, device="a100-80gb", tp=8, pp=35,
               micro_batch_size=1, global_batch_size=1920, recompute="full", schedule="1f1b", chunks=1,
               stage_layers=(3,) * 35,  # Megatron-DeepSpeed's GPTModelPipe, partition_method 'type:transformer'
               sp=False,  # 2021: before Megatron's sequence parallelism
               assumed="micro-batch 1, Megatron's default dropouts (0.1)")  # fmt: skip

_DGXC_175B = dict(source="NVIDIA dgxc-benchmarking nemo_megatron/README_175b.md (BF16)", model=GPT3_175B,
                  device="h100-sxm", tp=4, pp=8, micro_batch_size=1, recompute="none", schedule="interleaved",
                  chunks=12, tp_overlap=True,
                  assumed="no recompute, sequence parallelism and TP communication overlap (ub_tp_comm_overlap) as the "
                  "recipe's gpt3_175b_hydra.yaml sets them, the overlap as --tp-overlap; its distributed_fused_adam as "
                  "ZeRO-1; FP8 off (DTYPE=bf16); vocabulary 51,200 as the README's FLOP count")  # fmt: skip

# MPT (llm-foundry's mpt_causal_lm): GPT-style, learned positions, tied embeddings, FlashAttention
# (triton or flash), no biases; vocabulary 50,368
MPT_7B = Model(layers=32, hidden=4096, heads=32, vocab=50368)
MPT_13B = Model(layers=40, hidden=5120, heads=40, vocab=50368)
MPT_30B = Model(layers=48, hidden=7168, heads=56, vocab=50368)
MPT_70B = Model(layers=80, hidden=8192, heads=64, vocab=50368)
_MPT = dict(source="MosaicML llm-foundry benchmarking README (H100 80GB BF16, large scale)", device="h100-sxm", tp=1,
            pp=1, schedule="1f1b", chunks=1, zero=3,
            assumed="H100 SXM; biases on every linear and norm (MPT has none: a few elementwise ops); FSDP's "
            "limit_all_gathers as one gather in flight ahead of the compute")  # fmt: skip


def _mpt(name: str, model: Model, gpus: int, micro_batch_size: int, tokens: int, tokens_per_s: float,
         recompute: str) -> Run:
    """One row of llm-foundry's table: its step is GlobalBatchSize (T) over Throughput (T/s)."""
    return Run(name=f"{name}-{gpus}", model=model, dp=gpus, micro_batch_size=micro_batch_size,
               global_batch_size=tokens // model.seq, recompute=recompute, published_s=tokens / tokens_per_s, **_MPT)


_MPT_ROWS = (  # name, model, MicroBatchSize, recompute; per # GPUs: (GlobalBatchSize (T), Throughput (T/s))
    ("mpt-7b", MPT_7B, 6, "none", {128: (1572864, 1340830), 256: (3145728, 2590548), 512: (6291456, 4951479)}),
    ("mpt-13b", MPT_13B, 16, "full", {128: (4194304, 650264), 256: (8388608, 1277214), 512: (16777216, 2535811)}),
    ("mpt-30b", MPT_30B, 8, "full", {128: (2097152, 281491), 256: (4194304, 550022), 512: (8388608, 1083366)}),
    ("mpt-70b", MPT_70B, 8, "full", {128: (2097152, 135490), 256: (4194304, 265149), 512: (8388608, 515636)}),
)

RUNS = (
    Run(name="bloom-176b", source="BLOOM tr11 README", model=BLOOM, device="a100-80gb", tp=4, pp=12, dp=8,
        micro_batch_size=2, global_batch_size=2048, recompute="full", schedule="1f1b", chunks=1, published_s=104.70,
        stage_layers=(5,) + (6,) * 10 + (5,),  # --pp-partition-method 'type:transformer|embedding', as the README shows
        sp=False, assumed="learned positions for ALiBi, no embedding LayerNorm"),
    Run(name="mt-nlg-530b-2240", dp=8, published_s=60.1, **_MT_NLG),
    Run(name="mt-nlg-530b-2800", dp=10, published_s=50.2, **_MT_NLG),
    Run(name="mt-nlg-530b-3360", dp=12, published_s=44.4, **_MT_NLG),
    Run(name="megascale-175b-256", dp=4, global_batch_size=768, published_s=40.0, **_MEGASCALE),
    Run(name="megascale-175b-1024", dp=16, global_batch_size=768, published_s=11.9, **_MEGASCALE),
    Run(name="megascale-175b-3072", dp=48, global_batch_size=6144, published_s=29.02, **_MEGASCALE),
    Run(name="megascale-175b-12288", dp=192, global_batch_size=6144, published_s=8.57, **_MEGASCALE),
    Run(name="dgxc-gpt3-175b-128", dp=4, global_batch_size=256, published_s=8.309, **_DGXC_175B),
    Run(name="dgxc-gpt3-175b-256", dp=8, global_batch_size=512, published_s=8.408, **_DGXC_175B),
    Run(name="dgxc-gpt3-175b-512", dp=16, global_batch_size=1024, published_s=8.42, **_DGXC_175B),
    Run(name="dgxc-gpt3-175b-1024", dp=32, global_batch_size=2048, published_s=8.453, **_DGXC_175B),
    Run(name="dgxc-gpt3-175b-2048", dp=64, global_batch_size=4096, published_s=8.49, **_DGXC_175B),
    *(_mpt(name, model, gpus, micro_batch_size, tokens, tokens_per_s, recompute)
      for name, model, micro_batch_size, recompute, by_gpus in _MPT_ROWS
      for gpus, (tokens, tokens_per_s) in by_gpus.items()),
)

NOT_EXPRESSIBLE = (
    ("NVIDIA dgxc Nemotron-4 15B and 340B on H100 (BF16)",
     "grouped-query attention and squared-ReLU MLPs not among the benchmark's model shapes; the GPT-3 175B rows "
     "of the same recipes are in the table"),
    ("Llama 3 405B, Llama 3 paper Table 4",
     "no step time published (TFLOPs per GPU under a FLOP count the paper does not state); 128k rows need "
     "context parallelism"),
    ("torchtitan docs/performance.md (Llama 3 8B-405B)",
     "96 GB H100s at 500 W, not a device spec here; float8 on some (its FSDP2, a unit per block with the next "
     "block's gather beside the compute, autopart now runs and models)"),
    ("NVIDIA dgxc Llama 3.1 8B / 70B / 405B", "context parallelism (CP 2) in every layout"),
    ("NeMo performance summary, H100 dense rows", "FP8"),
)


def predict(run: Run, folder: Path, *, search: bool) -> dict:
    model = run.model.file(folder)
    common = dict(device=run.device, dtype="bf16", gpus_per_node=8, optimizer="adamw",
                  global_batch_size=run.global_batch_size, tp_overlap=run.tp_overlap)  # fmt: skip
    start = time.perf_counter()
    try:
        row = {"plan": autopart.compile(model, tp=run.tp, pp=run.pp, dp=run.dp, zero=run.zero,
                                        micro_batch_size=run.micro_batch_size, recompute=run.recompute,
                                        schedule=run.schedule, chunks=run.chunks, sp=run.sp if run.tp > 1 else None,
                                        stage_layers=run.stage_layers, **common)}  # fmt: skip
    except autopart.AutopartError as error:  # the published layout does not compile: the search may still
        row = {"error": str(error)}
    row["compile_s"] = time.perf_counter() - start
    if search:
        start = time.perf_counter()
        row["searched"] = autopart.compile(model, world_size=run.gpus, **common)
        row["search_s"] = time.perf_counter() - start
    return row


def describe_split(counts: tuple[int, ...]) -> str:
    """``5,6x10,5``: layers per stage, runs of equal counts folded."""
    runs: list[list[int]] = []
    for count in counts:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    return ",".join(f"{count}x{times}" if times > 1 else str(count) for count, times in runs)


def describe_plan(plan) -> str:
    """A searched plan's layout in the table's words: ``t2 p8 d8 zbv b1 full zero1``."""
    modes = sorted({stage.recompute for stage in plan.stages})
    return (f"t{plan.mesh['tp']} p{plan.mesh['pp']} d{plan.mesh['dp']} {plan.schedule.kind} "
            f"b{plan.schedule.micro_batch_size} {'/'.join(modes)} zero{int(plan.zero)}")


def mfu(run: Run, step_s: float) -> float:
    peak = get_cost_model(run.device).device.peak_flops["bfloat16"]
    return run.model.flops(run.global_batch_size) / (step_s * run.gpus * peak)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row names (default: all)")
    parser.add_argument("--search", action="store_true", help="also search each row's cluster and batch")
    parser.add_argument("--no-write", action="store_true",
                        help="do not record the error band in autopart/predict/accuracy.json (which compile prints)")
    args = parser.parse_args(argv)
    runs = [r for r in RUNS if not args.rows or r.name in args.rows]
    console = Console()
    table = Table(title="predicted step (layout pinned) against published runs, bf16")
    for column in ("run", "GPUs", "layout", "published s", "predicted s", "error", "MFU pub.", "MFU pred.",
                   *(("searched s", "searched layout") if args.search else ()), "source"):
        table.add_column(column, justify="left" if column in ("run", "layout", "source", "searched layout") else "right")
    errors = []
    errors_by_zero: list[tuple[float, str, int, str]] = []  # the bands are written apart for ZeRO-3 rows and the rest
    with tempfile.TemporaryDirectory() as folder:
        for run in runs:
            row = predict(run, Path(folder), search=args.search)
            searched = ()
            if args.search:
                found = row["searched"]
                searched = (f"{found.predicted.step_s:.2f}", describe_plan(found))
            if "error" in row:
                table.add_row(run.name, str(run.gpus), "", f"{run.published_s:.2f}", "-", "-", "", "", *searched,
                              row["error"])
                continue
            console.print(f"{run.name}: predicted {row['plan'].predicted.step_s:.2f} s, published {run.published_s} s "
                          f"(compiled in {row['compile_s']:.0f} s)")  # fmt: skip
            step = row["plan"].predicted.step_s
            errors.append(step / run.published_s - 1)
            # every row trains in bf16; its band holds for the layouts and ZeRO levels the rows ran (a
            # single GPU's or a TP group's step, or FSDP's messages, was never held to one)
            errors_by_zero.append((errors[-1], f"{run.device}/bf16", run.zero, layout_of(row["plan"])))
            layout = (f"t{run.tp} p{run.pp} d{run.dp} {run.schedule}{f' v{run.chunks}' if run.chunks > 1 else ''} "
                      f"b{run.micro_batch_size} {run.recompute}{'' if run.sp or run.tp == 1 else ' no-sp'}"
                      f"{' overlap' if run.tp_overlap else ''}{f' zero{run.zero}' if run.zero != 1 else ''} "
                      f"{run.model.attention}"
                      f"{f' {describe_split(run.stage_layers)}' if run.stage_layers else ''}")  # fmt: skip
            table.add_row(run.name, str(run.gpus), layout, f"{run.published_s:.2f}", f"{step:.2f}",
                          f"{100 * errors[-1]:+.1f}%", f"{100 * mfu(run, run.published_s):.1f}%",
                          f"{100 * mfu(run, step):.1f}%", *searched, run.source)  # fmt: skip
    console.print(table)
    absolute = [abs(e) for e in errors]
    if absolute:  # none where no row compiled
        console.print(f"median |error| {100 * statistics.median(absolute):.1f}%, worst {100 * max(absolute):.1f}% "
                      f"over {len(errors)} rows")  # fmt: skip
    if errors and not args.no_write:
        command = " ".join(["python", "benchmarks/published_runs.py", *(argv or sys.argv[1:])])
        for suffix, rows, benchmark in (("", "the rows without ZeRO-3", "published_runs"),
                                        (FULLY_SHARDED, "the ZeRO-3 rows", "published_runs, its ZeRO-3 rows")):
            these = [row for row in errors_by_zero if (row[2] == 3) == bool(suffix)]
            if these:
                errors_of, covers, levels, layouts = zip(*these)
                band = Band.from_errors(list(errors_of), benchmark=benchmark, command=command,
                                        covers=tuple(set(covers)), layouts=layouts, zero=levels)
                written = write_band(band_key(ROOFLINE, None) + suffix, band)
                console.print(f"wrote the band of the GPU specs' roofline over {rows} to {written}")
    for name, why in NOT_EXPRESSIBLE:
        console.print(f"not expressible yet: {name}: {why}")
    for run in runs:
        if run.assumed:
            console.print(f"assumed in {run.name}: {run.assumed}")
    return 1 if len(errors) < len(runs) else 0  # a published layout that no longer compiles is a regression


if __name__ == "__main__":
    sys.exit(main())
