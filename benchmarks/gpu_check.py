"""The generated programs on one GPU, checked in one prepared run of a few minutes.

    python benchmarks/gpu_check.py --prepare DIR [--device cuda|cpu] [--model FILE]   # where OR-Tools is
    python benchmarks/gpu_check.py --run DIR [--steps 30]                             # on the GPU machine

``--prepare`` compiles, here, the plans that need the solver or that the run compares against,
for the h200 spec (``--device cuda``) or this CPU (``--device cpu``):

- ``fp32``, ``bf16``: one stage on one rank, one microbatch, so that the program and a
  single-process run of the same batches compute the same products;
- ``interleaved``: two stages on one rank (interleaved, two chunks), handed over in memory;
- ``zb-dropout``, ``-selective``, ``-full``: a model with dropout (tests/models/dropout_gpt.py)
  under a split backward, without and with recompute, one microbatch: the draws of one process;
- ``roofline``: a Llama-shaped model of about half a billion parameters (a few layers of width 64
  on the CPU), built on the meta device so that nothing of it travels, compiled from the spec
  alone, as a user who names a GPU (``--device h200``) compiles before any run.

``--run`` then needs torch and autopart alone (no OR-Tools: the one compile it makes has one
stage and builds no CP-SAT model). Each row of its table is one check:

1. each prepared plan trains ``--steps`` steps under torchrun (NCCL on a GPU, gloo on the CPU),
   and every step's loss equals a single-process run's on the same device (fp32 to 1e-5; bf16 to
   `autopart verify`'s tolerance);
2. ``autopart profile --device cuda`` (in the plans' precision), then ``autopart compile
   --costs``: the predicted step against the measured median step (target 15%), the predicted
   peak memory, less what lives outside PyTorch's allocator (the CUDA context, NCCL's buffers; the
   cuBLAS workspaces are inside it), against ``torch.cuda.max_memory_allocated`` (target 10%),
   and on a GPU the caching allocator's reserved peak beyond that, as a share of the device's
   memory (target: the compile's warning margin, `autopart.predict.headroom.ALLOCATOR_MARGIN`;
   the generated train.py runs with expandable segments);
3. the spec's matmul efficiency at each of its points against the kernel time of bf16 GEMMs of
   that size (25%);
4. the ``roofline`` plan's predicted step, from the spec alone, against its measured median step
   (20%, the bound published_runs holds the spec rooflines to), and its predicted peak memory
   against the allocator's (10%).

It exits 1 when a check fails. On the CPU (gloo) it runs the same code paths, so that the suite
(``tests/test_gpu_check.py``) keeps it working; there the figures of rows 2 to 4 are printed
but not judged: a shared CPU's step times and resident memory are not what the GPU model predicts.
On a GPU other than the prepared spec's (an H100 where the plans were compiled for the h200) the
rows of 3 are judged against the spec of the GPU at hand, where there is one, and the roofline's
predictions of 4 are printed but not judged: they are another GPU's (`judging`). A torch whose
major.minor differs from the one the plans were compiled under is warned about: its kernels, and
so the measured figures, may differ from those the plans were made with.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from autopart.tools.local_run import run_locally  # noqa: E402
from autopart.ir.plan import load_plan  # noqa: E402
from autopart.predict.headroom import ALLOCATOR_MARGIN  # noqa: E402
from autopart.runtime.reference import train_reference  # noqa: E402
from autopart.tools.verify import BF16_LOSS_TOLERANCE, LOSS_TOLERANCE  # noqa: E402

MODEL = REPO / "examples" / "gpt.py"
SPEC = {"cuda": "h200", "cpu": "cpu"}  # the device spec each kind of run is compiled for
PLANS = {
    "fp32": {"microbatches": 1, "dtype": "fp32", "schedule": "1f1b", "chunks": 1},
    "bf16": {"microbatches": 1, "dtype": "bf16", "schedule": "1f1b", "chunks": 1},
    "interleaved": {"microbatches": 2, "dtype": "fp32", "schedule": "interleaved", "chunks": 2},
    # dropout with a split backward, and recomputed: a plan of one stage, microbatch and rank draws
    # what one process draws (`autopart.runtime.draws.draw_seed`), and a recompute must draw it again
    "zb-dropout": {"model": "dropout", "microbatches": 1, "dtype": "fp32", "schedule": "zb-h1", "chunks": 1},
    "zb-dropout-selective": {"model": "dropout", "microbatches": 1, "dtype": "fp32", "schedule": "zb-h1",
                             "chunks": 1, "recompute": "selective"},
    "zb-dropout-full": {"model": "dropout", "microbatches": 1, "dtype": "fp32", "schedule": "zb-h1", "chunks": 1,
                        "recompute": "full"},
}
DROPOUT_MODEL = REPO / "tests" / "models" / "dropout_gpt.py"
MICRO_BATCH_SIZE = 4
PROFILED_MICROBATCHES = 4  # the plan whose step and memory are predicted from measured ops
LR, OPTIMIZER = 0.1, "sgd"  # verify's: SGD moves every parameter by a known amount per step
STEP_TARGET, MEMORY_TARGET, GEMM_TARGET, ROOFLINE_TARGET = 0.15, 0.10, 0.25, 0.20
ROOFLINE_SOURCE = REPO / "examples" / "llama_7b.py"  # built on the meta device: each rank makes its weights
ROOFLINE_CONFIG = {  # Llama-shaped, about 0.5B parameters: compute-bound on a GPU, seconds a run
    "cuda": "LlamaConfig(vocab_size=32000, seq_len=2048, n_layer=8, n_head=16, dim=2048, ffn_dim=5632)",
    "cpu": "LlamaConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, dim=64, ffn_dim=172)",
}
ROOFLINE_PLAN = {"micro_batch_size": 2, "microbatches": 4, "schedule": "1f1b", "chunks": 1}
GEMM_BATCH_S = 0.02  # host seconds of back-to-back products that size a timed sample (see _gemm_seconds)
WARMUP_STEPS = 3  # steps left out of the measured median: allocator, kernels chosen, caches
# The cuBLAS workspaces are part of the framework's overhead that PyTorch takes through its own
# caching allocator (one per cuBLAS handle and stream, 32 MiB each on Hopper as cuBLAS recommends):
# the forward's thread and autograd's backward thread each have one, so max_memory_allocated holds two.
# Hopper's size: the check's CUDA plans are the h200 spec's (other GPUs take 4-8 MiB each).
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2**20


@dataclass(frozen=True, kw_only=True)
class Row:
    check: str
    figure: str
    target: str
    passed: bool | None  # None: printed, not judged (on the CPU)
    detail: str = ""  # why a check could not run, whole: printed below the table


def prepare(folder: Path, device: str, model: Path) -> None:
    """Compile the plans of ``--run`` into ``folder`` (this needs OR-Tools for the interleaved cut)."""
    from autopart.driver import CompileOptions, compile_to_directory

    folder.mkdir(parents=True, exist_ok=True)
    for name, settings in PLANS.items():
        settings = dict(settings)
        plan_model = DROPOUT_MODEL if settings.pop("model", None) == "dropout" else model
        if device == "cpu" and settings["dtype"] == "bf16":  # CPU autocast runs norms in their input's dtype:
            settings = settings | {"dtype": "bf16-autocast"}  # fp32 inputs cannot meet bf16 norm weights there
        options = CompileOptions(
            model=plan_model, pp=1, tp=1, dp=1, device=SPEC[device], micro_batch_size=MICRO_BATCH_SIZE,
            optimizer=OPTIMIZER, **settings,
        )  # fmt: skip
        compile_to_directory(options, folder / name)
    _prepare_roofline(folder, device)
    (folder / "check.json").write_text(json.dumps({"device": device, "spec": SPEC[device]}) + "\n")
    print(f"prepared {', '.join([*PLANS, 'roofline'])} in {folder}; run: python benchmarks/gpu_check.py --run {folder}")


def _prepare_roofline(folder: Path, device: str) -> None:
    """The ``roofline`` plan: examples/llama_7b.py at ``ROOFLINE_CONFIG``'s size, written whole into
    the folder (the compiled copy must not import the repo's examples), compiled from the spec."""
    from autopart.driver import CompileOptions, compile_to_directory

    source = ROOFLINE_SOURCE.read_text()
    default = "CONFIG = LlamaConfig()\n"
    if default not in source:
        raise SystemExit(f"{ROOFLINE_SOURCE} no longer sets {default.strip()!r}; update gpu_check's roofline model")
    model = folder / "roofline_model.py"
    model.write_text(source.replace(default, f"CONFIG = {ROOFLINE_CONFIG[device]}\n"))
    dtype = "bf16" if device == "cuda" else "fp32"
    options = CompileOptions(model=model, pp=1, tp=1, dp=1, device=SPEC[device], dtype=dtype, **ROOFLINE_PLAN)
    compile_to_directory(options, folder / "roofline")


def _train(out: Path, steps: int, work: Path, *, gpus: bool, verify_optimizer: bool = True) -> list[dict]:
    """``torchrun`` the one-rank program for ``steps``; its metrics lines. With ``verify_optimizer``
    it trains with verify's optimizer (the plans compiled for it); else with its plan's own."""
    metrics = work / f"{out.name}.jsonl"
    metrics.unlink(missing_ok=True)
    optimizer = ["--lr", str(LR), "--optimizer", OPTIMIZER] if verify_optimizer else []
    args = ["--steps", str(steps), *optimizer, "--metrics", str(metrics)]
    run_locally(out, 1, args, timeout_s=240, cwd=work, gpus=gpus)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _same_losses(folder: Path, name: str, steps: int, work: Path, device: str) -> Row:
    out = folder / name
    plan = load_plan(out / "plan.json")
    losses = [m["loss"] for m in _train(out, steps, work, gpus=device == "cuda")]
    reference = train_reference(out, steps=steps, lr=LR, optimizer=OPTIMIZER, device=device).losses
    atol, rtol = BF16_LOSS_TOLERANCE if plan.dtype.startswith("bf16") else LOSS_TOLERANCE
    gaps = [abs(a - b) - rtol * abs(b) for a, b in zip(losses, reference)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    stages = f"{len(plan.stages)} stages on 1 rank, " if len(plan.stages) > 1 else ""
    recompute = f"{plan.stages[0].recompute} recompute, " if plan.stages[0].recompute != "none" else ""
    return Row(
        check=f"{name}: {stages}{recompute}{steps} steps, losses = one process",
        figure=f"worst step {worst}: {losses[worst]:.6f} vs {reference[worst]:.6f}",
        target=f"|diff| <= {atol:g} + {rtol:g}|loss|",
        passed=len(losses) == steps and all(g <= atol for g in gaps),
    )


def _profiled(folder: Path, model: Path, steps: int, work: Path, device: str) -> list[Row]:
    """``autopart profile`` then ``autopart compile --costs``, as a user runs them; the plan's
    predictions against a run of it."""
    from cost_models.devices import local_device_name

    costs, out = work / "costs.json", work / "profiled"
    dtype = "bf16" if device == "cuda" else "fp32"
    common = ["--micro-batch-size", str(MICRO_BATCH_SIZE)]
    _cli("profile", str(model), "-o", str(costs), "--device", device, "--dtype", dtype, *common)
    _cli("compile", str(model), "-o", str(out), "--device", local_device_name(device), "--costs", str(costs),
         "--pp", "1", "--tp", "1", "--dp", "1", "--microbatches", str(PROFILED_MICROBATCHES), "--dtype", dtype,
         "--global-batch-size", str(MICRO_BATCH_SIZE * PROFILED_MICROBATCHES), "--optimizer", OPTIMIZER)  # fmt: skip
    return _against_run(out, steps, work, device, what=f"profiled {dtype} plan", step_target=STEP_TARGET)


def _roofline(folder: Path, steps: int, work: Path, device: str, judged: Judged) -> list[Row]:
    """The plan compiled from the spec alone, run with the optimizer it was compiled for (AdamW,
    what users train with): its predicted step and peak against the run's, judged only on a GPU
    of the spec it was compiled for."""
    plan = load_plan(folder / "roofline" / "plan.json")
    what = f"{plan.dtype} {judged.prepared} roofline plan ({plan.provenance.cost_model})"
    return _against_run(folder / "roofline", steps, work, device, what=what, step_target=ROOFLINE_TARGET,
                        verify_optimizer=False, judged=judged.roofline)


def _against_run(out: Path, steps: int, work: Path, device: str, *, what: str, step_target: float,
                 verify_optimizer: bool = True, judged: bool = True) -> list[Row]:
    """The compiled plan in ``out`` run: its predicted step against the measured median step (past
    the warm-up), its predicted peak against the run's; judged on a GPU only, and there only where
    ``judged`` (the plan's spec is the GPU's)."""
    plan = load_plan(out / "plan.json")
    metrics = _train(out, max(steps, WARMUP_STEPS + 3), work, gpus=device == "cuda", verify_optimizer=verify_optimizer)
    measured = statistics.median(m["step_s"] for m in metrics[WARMUP_STEPS:])
    peak = metrics[-1]["peak_memory_bytes"][0]
    predicted, predicted_peak = plan.predicted.step_s, plan.predicted.memory_bytes[0]
    gpu = device == "cuda"
    judged = gpu and judged
    if gpu:  # the allocator sees the model's tensors and the cuBLAS workspaces, not the CUDA context or NCCL's buffers
        predicted_peak -= _outside_allocator_bytes(plan)
    step_error, memory_error = predicted / measured - 1, predicted_peak / peak - 1
    measured_by = "max_memory_allocated (less the CUDA context)" if gpu else "resident memory (CPU)"
    reserved = metrics[-1].get("peak_reserved_bytes", [None])[0]
    device_bytes = torch.cuda.get_device_properties(0).total_memory if reserved is not None else 0
    allocator = [] if reserved is None else [
        Row(check=f"{what}: the caching allocator's reserved peak beyond its allocated peak",
            figure=f"{(reserved - peak) / 2**20:.1f} MiB beyond {peak / 2**20:.1f} "
                   f"({(reserved - peak) / device_bytes:.2%} of the device)",
            target=f"within {ALLOCATOR_MARGIN:.0%} of the device (the compile's warning margin)",
            passed=reserved - peak <= ALLOCATOR_MARGIN * device_bytes)]
    return [
        Row(check=f"{what}: predicted step vs measured median",
            figure=f"{predicted * 1e3:.3f} vs {measured * 1e3:.3f} ms ({step_error:+.1%})",
            target=f"within {step_target:.0%}", passed=abs(step_error) <= step_target if judged else None),
        Row(check=f"{what}: predicted peak memory vs {measured_by}",
            figure=f"{predicted_peak / 2**20:.1f} vs {peak / 2**20:.1f} MiB ({memory_error:+.1%})",
            target=f"within {MEMORY_TARGET:.0%}", passed=abs(memory_error) <= MEMORY_TARGET if judged else None),
    ] + allocator  # fmt: skip


def _outside_allocator_bytes(plan) -> int:
    """What a GPU plan's predicted memory holds besides PyTorch's allocations: the framework's
    overhead (the CUDA context and library state) less the cuBLAS workspaces, which PyTorch
    allocates itself, and the collective library's buffers."""
    from cost_models.devices import load_device
    from cost_models.memory import communicator_bytes

    spec = load_device(plan.provenance.cost_model.rpartition(":")[2])
    inside = CUBLAS_WORKSPACE_BYTES if spec.kind == "cuda" else 0
    return spec.framework_overhead_bytes - inside + communicator_bytes(spec.kind, **plan.mesh, schedule=plan.schedule.kind)


def _cli(*args: str) -> None:
    """``autopart ARGS`` as a user runs it, in this process: its imports are paid once."""
    from autopart.tools.cli import main as autopart

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            autopart(list(args))
    except SystemExit as exc:
        if exc.code:
            raise SystemExit(f"autopart {args[0]} failed (exit {exc.code}): {printed.getvalue()[-2000:]}") from None


def _gemm_seconds(n: int, device: torch.device, dtype: torch.dtype) -> float:
    """Median seconds of one n x n x n matrix product: on a GPU the kernel's own time, products
    replayed back to back from a CUDA graph and timed with CUDA events, since the spec's efficiency
    is the kernel's (the roofline adds ``kernel_overhead_s`` per launch apart); on the CPU a loop
    timed by the host's clock. A sample holds as many products as the host launches in about
    ``GEMM_BATCH_S`` (at most 1000): the host's launch time is at least the kernel's, so a sample
    is long beside the events' own cost and one graph launch; of eight samples the first three
    warm the clocks and caches up."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    cuda = device.type == "cuda"
    began = time.perf_counter()
    for _ in range(3):
        torch.matmul(a, b)
    if cuda:
        torch.cuda.synchronize(device)
    one = max((time.perf_counter() - began) / 3, 1e-6)
    count = max(1, min(1000, round(GEMM_BATCH_S / one)))

    def batch() -> None:
        for _ in range(count):
            torch.matmul(a, b)

    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            batch()
        batch = graph.replay
    samples = []
    for timed in range(8):  # the first three warm the clocks and caches up
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            batch()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            began = time.perf_counter()
            batch()
            seconds = time.perf_counter() - began
        if timed >= 3:
            samples.append(seconds / count)
    return statistics.median(samples)


def _gemms(device: str, judged: Judged) -> list[Row]:
    """The spec's efficiency curve at its own points against measured GEMMs of those sizes (bf16 on
    a GPU; fp32 on the CPU, whose spec is calibrated in fp32; the largest skipped there): the spec
    of the GPU at hand, else the prepared one's, printed but not judged."""
    from cost_models.devices import load_device

    spec = load_device(judged.gemm_spec)
    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    dtype, peak_name = (torch.bfloat16, "bfloat16") if device == "cuda" else (torch.float32, "float32")
    rows = []
    for log_flops, _ in spec.matmul_efficiency:
        if device == "cpu" and log_flops > 9.5:
            continue
        n = max(64, round((10**log_flops / 2) ** (1 / 3) / 64) * 64)  # a model's widths: tensor cores need 8 | n
        flops = 2 * n**3
        measured = flops / _gemm_seconds(n, where, dtype) / spec.peak_flops[peak_name]
        expected = spec.matmul_efficiency_at(flops)
        error = measured / expected - 1
        rows.append(Row(check=f"{spec.name} matmul efficiency, {dtype_name(dtype)} {n}^3 (1e{log_flops:.1f} FLOPs)",
                        figure=f"measured {measured:.3f} vs spec {expected:.3f} ({error:+.0%})",
                        target=f"within {GEMM_TARGET:.0%}",
                        passed=abs(error) <= GEMM_TARGET if judged.gemms else None))  # fmt: skip
    return rows


def _data_draws(device: str) -> list[Row]:
    """A model file's ``batches`` that draws on the device from its global generator (``torch.randint(...,
    device="cuda")``) draws the same batches whatever training seeded between two draws
    (`autopart.runtime.data.apart`): each forward seeds every generator per stage, so each pipeline
    rank's would differ, and the last stage's targets would not be the first stage's tokens."""
    from autopart.runtime.data import apart

    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")

    def batches():
        while True:
            yield torch.randint(0, 1000, (64,), device=where)

    drawn = []
    for training_seed in (1, 2):
        source = apart(batches, seed=7)
        draws = []
        for step in range(3):
            torch.manual_seed(training_seed * 100 + step)  # what a forward does to every generator
            draws.append(next(source).cpu())
        drawn.append(torch.stack(draws))
    same = torch.equal(*drawn) and not torch.equal(drawn[0][0], drawn[0][1])
    return [Row(check=f"batches drawn on {where.type} apart from training's seeds", figure="same" if same else "differ",
                target="the same batches", passed=same)]


def _checked(what: str, check: Callable[[], list[Row]]) -> list[Row]:
    """The check's rows, or one failed row that says why it could not run: one machine session
    should report every check, not stop at the first that breaks (a module missing there, say)."""
    try:
        return check()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported in the table, and it fails the run
        reason = " ".join(str(exc).split())[-300:]
        return [Row(check=what, figure=f"{type(exc).__name__}: {reason}", target="runs", passed=False,
                    detail=str(exc))]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, kw_only=True)
class Judged:
    """What a run's rows are judged against: ``prepared``, the spec the plans were compiled for;
    ``gemm_spec``, the spec the GEMM rows are measured against, and whether they (``gemms``) and
    the roofline plan's predictions (``roofline``) are judged; ``warnings``, printed first."""

    prepared: str
    gemm_spec: str
    gemms: bool
    roofline: bool
    warnings: tuple[str, ...]


def judging(device: str, prepared: str, here: str, known: list[str], plans_torch: str, torch_here: str) -> Judged:
    """The judgement of a run of plans prepared for spec ``prepared`` (under torch ``plans_torch``)
    on the device ``here`` (its spec name, `local_device_name`; ``known``: the specs there are).
    On the CPU nothing is judged (the module docstring says why). On a GPU of another spec the
    roofline plan's predictions are another GPU's, and the GEMM rows are judged against the spec
    of the GPU at hand, or, where it has none, printed against the prepared one's."""
    gpu = device == "cuda"
    warnings = []
    if gpu and here != prepared:
        warnings.append(f"the plans were prepared for {prepared}, this GPU is {here}: the roofline plan's predictions "
                        "are not judged, the GEMMs " + (f"are judged against {here}'s spec" if here in known else
                                                        f"are not judged ({here} has no spec)"))
    if _major_minor(plans_torch) != _major_minor(torch_here):
        warnings.append(f"the plans were compiled under torch {plans_torch}, this is torch {torch_here}: kernels, "
                        "and so the measured figures, may differ from those the plans were made with")
    own = here in known
    return Judged(prepared=prepared, gemm_spec=here if gpu and own else prepared, gemms=gpu and own,
                  roofline=gpu and here == prepared, warnings=tuple(warnings))


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def run(folder: Path, steps: int) -> int:
    """Every check, its table; 1 when one failed."""
    from cost_models.devices import known_devices, local_device_name

    folder = folder.resolve()  # the runs start in a scratch folder
    check = json.loads((folder / "check.json").read_text())
    device = check["device"]
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{folder} was prepared for CUDA but no GPU is visible here; prepare with --device cpu")
    judged = judging(device, check.get("spec", SPEC[device]), local_device_name(device), known_devices(),
                     load_plan(folder / "fp32" / "plan.json").provenance.torch_version, torch.__version__)
    for warning in judged.warnings:
        print(f"gpu_check: warning: {warning}")
    started = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        work = Path(scratch)
        for name in PLANS:
            rows.extend(_checked(name, lambda name=name: [_same_losses(folder, name, steps, work, device)]))
        model = folder / "fp32" / "model.py"  # the compiled copy
        rows.extend(_checked("profile, compile --costs", lambda: _profiled(folder, model, steps, work, device)))
        rows.extend(_checked("roofline", lambda: _roofline(folder, steps, work, device, judged)))
    rows.extend(_checked("matmul efficiency", lambda: _gemms(device, judged)))
    rows.extend(_checked("data draws", lambda: _data_draws(device)))
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu (gloo)"
    print(f"gpu_check on {where}, torch {torch.__version__}, {time.perf_counter() - started:.0f} s")
    width = max(len(r.check) for r in rows)
    for row in rows:
        status = {True: "ok", False: "FAIL", None: "-"}[row.passed]
        print(f"{status:4}  {row.check:{width}}  {row.figure}  [{row.target}]")
    for row in rows:
        if row.detail:  # the rank's own last words (a C++ abort, a CUDA error) come before torchrun's summary
            print(f"\n--- {row.check} ---\n{row.detail}")
    failed = sum(row.passed is False for row in rows)
    print(f"{failed} failed of {sum(row.passed is not None for row in rows)} judged checks")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--prepare", type=Path, metavar="DIR", help="compile the plans into DIR (needs OR-Tools)")
    action.add_argument("--run", type=Path, metavar="DIR", help="run the checks on the plans in DIR")
    parser.add_argument("--device", choices=SPEC, default="cuda", help="what --prepare compiles for (default cuda)")
    parser.add_argument("--model", type=Path, default=MODEL, help="model file (default examples/gpt.py)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.prepare, args.device, args.model)
        return 0
    return run(args.run, args.steps)


if __name__ == "__main__":
    sys.exit(main())
