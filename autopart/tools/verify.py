"""``autopart verify OUT``: run the generated programs beside the original model and compare.

The programs run on this machine (`autopart.tools.local_run`), on its GPUs with NCCL when the plan was
compiled for a GPU and each rank can have one (`autopart.tools.local_run.runs_on_gpus`), else with
gloo on the CPU; the original model trains in this process on the same device, on the same
batches from the same initial weights (``autopart.runtime.reference``), in one forward per step,
or in one per microbatch of each replica where the model normalises by its batch (BatchNorm), as
the plan does. Any user can so check any compile: the losses of
every step and every final parameter must agree to float tolerance (under AdamW, as far as the
order of the sums lets them: `ORDER_NOISE_FACTOR`).
"""

from __future__ import annotations

import ast
import logging
import json
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from autopart.ir.errors import ConfigError
from autopart.tools.local_run import run_locally, runs_on_gpus
from autopart.ir.plan import Plan, load_plan
from autopart.runtime.launch import check_output
from autopart.runtime.recipe import Recipe
from autopart.runtime.reference import ReferenceRun, initial_weights, plan_parts, train_reference
from autopart.runtime.shards import load_stage_weights

log = logging.getLogger("autopart")

__all__ = ["Verification", "verify", "DEFAULT_LR", "LOSS_TOLERANCE", "PARAMETER_TOLERANCE"]

LOSS_TOLERANCE = (1e-5, 1e-5)  # (atol, rtol): fp32 sums in another order
PARAMETER_TOLERANCE = (1e-5, 1e-4)
BF16_LOSS_TOLERANCE = (1e-5, 1.6e-2)  # torch.testing's bf16 rtol: about four roundings of 2**-8
BF16_SHARE_OF_STEP = 2e-2
"""A bf16 plan rounds at other places than one bf16 process (each microbatch's weight gradient
before the fp32 sum, matrix products of another batch size): its parameters may differ by this
share of how far training moved them."""
BF16_NOISE_FACTOR = 2.0
"""Under ``bf16`` (working weights) every weight gradient is bf16 in each microbatch, the norms'
and embeddings' too, and where a gradient's microbatch parts nearly cancel, one rounding of each
is a large share of what training moved: such a parameter may also differ by this many times
how far one bf16 process ends from fp32 training (the rounding noise of the precision itself)."""
DEFAULT_LR = {"sgd": 0.1, "adamw": 1e-3}
"""SGD's steps are the gradients, scaled: a large rate makes a wrong gradient plain in few steps.
AdamW's are about the rate whatever the gradient, and at 0.1 a small model's loss climbs: train.py's
default keeps it training, as it would be trained."""
ORDER_NOISE_FACTOR = 2.0
"""AdamW divides each gradient by its own running size, so an element whose gradient is within
rounding of zero (its parts over the batch nearly cancel) moves by up to the learning rate either
way, and which way hangs on the order the sums were taken in, which a plan changes (microbatches,
replicas, tensor-parallel pieces): many elements in fp32, more in bf16. No element's difference
then says much, but a row's mean difference does: under AdamW a parameter whose elements are not
all within the tolerance of rounding matches where each row's (each slice of its first dimension;
a vector is one row) mean difference is at most this many times the largest that one process
gives, in that row or in the whole tensor, when it sums each step's gradient in another order
(`_order_noise`); a step's loss likewise. A wrong update or gradient direction in a row, or in a
shard of rows, moves most of its elements. Under bf16 a row may also differ as far
as the precision's rounding takes one process (`BF16_NOISE_FACTOR`'s measure). AdamW does not see
a gradient's scale (unclipped, a missing 1/dp leaves its steps as they were), nor a bug within the
noise of the whole tensor, nor tell a bug from roundings
that no order of one process's sums makes (a tensor-parallel plan's pieces summed in bf16): SGD,
the default, checks the gradients."""


@dataclass(frozen=True, kw_only=True)
class Verification:
    steps: int
    losses: list[float]  # the distributed run's
    reference_losses: list[float]
    loss_difference: float  # largest absolute difference over the steps
    loss_step: int
    parameter_difference: float  # largest absolute difference over every element of every parameter
    parameter: str  # where it is
    failures: list[str]  # beyond tolerance: the steps and parameters, worst first
    loss_tolerance: str  # the tolerances applied, as the verdict prints them: a bf16 plan's are looser
    parameter_tolerance: str
    without_dropout: bool = False  # both trained with every dropout passing its input (`_draws_apart_from_one_process`)
    reference_parts: tuple[int, int] = (1, 1)  # (replicas, microbatches) the reference ran one forward each on (`plan_parts`)

    @property
    def matches(self) -> bool:
        return not self.failures


def _bf16_noise(out_dir: Path, parameters: dict[str, torch.Tensor], *, steps: int, lr: float, optimizer: str,
                gpus: bool, recipe: Recipe, dropout: bool) -> dict[str, torch.Tensor]:
    """Per parameter, elementwise, how far one bf16 process ends from one fp32 process."""
    fp32 = train_reference(out_dir, steps=steps, lr=lr, optimizer=optimizer, device="cuda" if gpus else "cpu",
                           recipe=recipe, dtype="fp32", dropout=dropout)  # fmt: skip
    return {name: (_wide(value) - _wide(fp32.parameters[name])).abs() for name, value in parameters.items()}


@dataclass(frozen=True, kw_only=True)
class _OrderNoise:
    """How far the order of the sums alone takes training (`ORDER_NOISE_FACTOR`)."""

    rows: dict[str, torch.Tensor]  # per parameter, per row, the largest mean difference
    means: dict[str, float]  # per parameter, the largest mean difference
    losses: list[float]  # per step, the largest loss difference
    exact: bool = False  # an fp64 run is among the orders (an fp32 plan's)

    def covers(self, name: str, gap: torch.Tensor, precision: torch.Tensor | None = None) -> bool:
        """Whether each row of a parameter's difference ``gap`` is within what the order makes, or
        the precision's own rounding (``precision``: elementwise, how far a bf16 process ends from
        fp32's; a tensor-parallel plan adds its pieces' products in bf16, where one process rounds
        their sum once)."""
        if name not in self.rows:
            return False
        noise = ORDER_NOISE_FACTOR * torch.maximum(self.rows[name], torch.full_like(self.rows[name], self.means[name]))
        if precision is not None:
            noise = torch.maximum(noise, BF16_NOISE_FACTOR * _row_means(precision))
        return bool((_row_means(gap) <= noise).all())


def _row_means(gap: torch.Tensor) -> torch.Tensor:
    """A difference's mean per slice of its first dimension (a vector or a scalar: one row)."""
    return gap.flatten(1).mean(1) if gap.dim() >= 2 else gap.reshape(1, -1).mean(1)


def _order_noise(out_dir: Path, reference: ReferenceRun, plan: Plan, *, steps: int, lr: float, optimizer: str,
                 gpus: bool, recipe: Recipe, dropout: bool, loss_tolerance: tuple[float, float]) -> _OrderNoise:
    """The largest differences from ``reference`` (one process's run) of one process that sums
    each step's gradient over the plan's microbatches of every replica, over twice as many and
    over half as many (2 or 4 parts where those are no count that divides the batch). A count
    whose first loss, before any step, is not the reference's (a loss that is no mean over the
    batch, a norm over it) is no other order of the same sums: left out. Where the model normalises
    by its batch (``plan.batch_statistics``; the reference runs the plan's own parts, `plan_parts`,
    one where the plan has one), other parts would train another function: there the samples of
    each part are shuffled instead, three ways.

    An fp32 plan also sums within a product in another order than one process does (a
    tensor-parallel plan adds its ranks' pieces of each), which no order of parts repeats: for it
    the reference is also run in fp64, the nearest to exact sums one process has. The plan's run
    and the reference each end about as far from exact as the reference ends from the fp64 run,
    so they may end twice as far apart: that difference counts twice."""
    batch = plan.schedule.global_batch_size
    parts = plan.schedule.microbatches * plan.mesh["dp"]
    counts = [k for k in dict.fromkeys((parts, 2 * parts, parts // 2, 2, 4)) if 1 < k <= batch and batch % k == 0]
    if plan.batch_statistics:  # another count of parts trains another function, the plan's one part too
        orders = [{"sample_order": seed} for seed in (1, 2, 3)]
    else:
        orders = [{"microbatches": count} for count in counts[:3]]
    if plan.dtype == "fp32":
        orders.append({"dtype": "fp64"})
    noise = _OrderNoise(rows={}, means={}, losses=[0.0] * steps)
    exact = False  # whether the fp64 run is among the orders compared
    atol, rtol = loss_tolerance
    for order in orders:
        try:
            other = train_reference(out_dir, steps=steps, lr=lr, optimizer=optimizer, device="cuda" if gpus else "cpu",
                                    recipe=recipe, dropout=dropout, **order)
        except (RuntimeError, TypeError) as error:
            if "dtype" not in order:
                raise
            # a forward that makes fp32 tensors of its own (torch.eye(n, dtype=torch.float32)) cannot run in fp64
            log.warning("verify: the fp64 reference run failed (%s): the plan is held to the orders of sums alone",
                        str(error).splitlines()[0])
            continue
        if abs(other.losses[0] - reference.losses[0]) > atol + rtol * abs(reference.losses[0]):
            continue
        weight = 2.0 if "dtype" in order else 1.0
        exact = exact or "dtype" in order
        for name, value in reference.parameters.items():
            if not value.numel():
                continue
            gap = weight * (_wide(other.parameters[name]) - _wide(value)).abs()
            rows, mean = _row_means(gap), float(gap.mean())
            noise.rows[name] = torch.maximum(noise.rows[name], rows) if name in noise.rows else rows
            noise.means[name] = max(noise.means.get(name, 0.0), mean)
        noise.losses[:] = [max(gap, weight * abs(a - b))
                           for gap, a, b in zip(noise.losses, other.losses, reference.losses)]
    return replace(noise, exact=exact)


def _reordered(order: _OrderNoise | None, what: str) -> str:
    """The verdict's words for what AdamW allows besides rounding (``what``: of the figure held)."""
    if order is None:
        return ""
    if not order.means:
        return "; AdamW: no other order of this batch's sums to compare with"
    exact = " or in fp64 (twice that difference)" if order.exact else ""
    return f"; or, AdamW, {what}within {ORDER_NOISE_FACTOR:g}x one process's summing in other orders{exact}"


def _draws(out_dir: Path) -> bool:
    """The stage programs call a dropout, or pass a ``dropout_p``, that is not a literal 0 (an
    attention's ``dropout_p=0.0``, a ``nn.Dropout(0.0)``) or a literal training=False; or they call
    a ``--leaf`` module (declared in ``LEAVES``), whose forward is the model's own code, unseen here."""
    trees = [ast.parse(path.read_text()) for path in (out_dir / "stages").glob("stage_*.py")]
    return any(_draws_in(node) or _declares_leaves(node) for tree in trees for node in ast.walk(tree))


def _declares_leaves(node: ast.AST) -> bool:
    return isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "LEAVES" for t in node.targets)


def _draws_in(call: ast.AST) -> bool:
    if not isinstance(call, ast.Call):
        return False
    keywords = {k.arg: k.value for k in call.keywords}
    function = ast.unparse(call.func)
    if "dropout_p" in keywords:  # an attention's
        return not _zero(keywords["dropout_p"])
    for name, place in _ATTENTION_DROPOUT_PLACES.items():  # given by place, as nn.MultiheadAttention gives it
        if function.endswith(name):
            return len(call.args) > place and not _zero(call.args[place])
    if "dropout" not in function.lower():
        return False
    # F.dropout and ATen's dropout and native_dropout alike: (input, p, training)
    probability = keywords.get("p", call.args[1] if len(call.args) > 1 else None)
    training = keywords.get("training", keywords.get("train", call.args[2] if len(call.args) > 2 else None))
    return not (_zero(probability) or (isinstance(training, ast.Constant) and training.value is False))


_ATTENTION_DROPOUT_PLACES = {"scaled_dot_product_attention": 4, "sharded_attention": 4,
                             "multi_head_attention_forward": 10}
"""Where the attentions a stage calls take their ``dropout_p`` by place (`autopart.runtime.forward.NoDropout`)."""


def _zero(node: ast.expr | None) -> bool:
    """A literal 0 or 0.0 (None: an argument left to its default, which for a dropout is not 0)."""
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 0


def _draws_apart_from_one_process(out_dir: Path, plan) -> bool:
    """The stage programs draw (`_draws`), and the plan has several stages, microbatches or ranks:
    it draws the masks per stage, microbatch and rank (a split tensor's slices from streams of
    their own), where one process draws them once (see `autopart.runtime.reference`). Then both
    train with every dropout passing its input (train.py's ``--no-dropout``), which leaves
    everything else the programs compute to compare."""
    split = len(plan.stages) > 1 or plan.schedule.microbatches > 1 or plan.world_size > 1
    return split and _draws(out_dir)


def _run_distributed(
    out_dir: Path, work: Path, *, steps: int, lr: float, optimizer: str, timeout_s: float, gpus: bool, recipe: Recipe,
    dropout: bool,
) -> None:
    plan = load_plan(out_dir / "plan.json")
    check_output(out_dir, plan)  # an output edited since its compile: refused here, not by a failed run
    train_args = ["--steps", str(steps), "--lr", str(lr), "--optimizer", optimizer, *recipe.train_args(),
                  "--metrics", str(work / "metrics.jsonl"), "--save-weights", str(work / "final"),
                  *([] if dropout else ["--no-dropout"])]
    run_locally(out_dir, plan.world_size, train_args, timeout_s=timeout_s, cwd=work, gpus=gpus)


def _wide(value: torch.Tensor) -> torch.Tensor:
    """``value`` in float64, or complex128 where it is complex (a rotary embedding's buffer): both
    parts compared, where float64 kept the real part alone."""
    return value.to(torch.complex128 if value.is_complex() else torch.float64)


def _gap(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|got - expected|: 0 where both are the same value, NaN or infinite too; infinite where only
    one of them is NaN or infinite. A NaN compares false with every tolerance, and would pass where
    it stands for a broken run."""
    same = (got == expected) | (got.isnan() & expected.isnan())
    return torch.where(same, 0.0, torch.nan_to_num((got - expected).abs(), nan=math.inf))


def _finite(tolerance: torch.Tensor | float) -> torch.Tensor:
    """A tolerance made of a reference value: none beyond its constant part where that value is
    NaN or infinite (else a gap of infinity would be within a tolerance of NaN)."""
    return torch.nan_to_num(torch.as_tensor(tolerance, dtype=torch.float64), nan=0.0, posinf=0.0)


def _unlisted_buffer_failures(reference: ReferenceRun) -> list[tuple[float, str]]:
    """The buffers that moved in the reference and that no stage file lists as updated: the
    programs move those once per forward, so once per microbatch, where one process moves them
    once per step (a reference of one forward per microbatch, as a plan with batch statistics
    has, moves them as the programs do, and its values would agree)."""
    return [(math.inf, f"buffer {name} moves in the model's forward, but no stage file lists it in updated_buffers: "
                       "the programs would move it once per microbatch") for name in reference.unlisted_moves]


def verify(out_dir: str | Path, *, steps: int = 3, lr: float | None = None, optimizer: str = "sgd",
           timeout_s: float = 600.0, recipe: Recipe | None = None) -> Verification:  # fmt: skip
    """``lr``: by default the optimizer's (`DEFAULT_LR`); ``recipe``: the learning-rate schedule,
    weight decay and clipping that both runs apply."""
    recipe = recipe or Recipe()
    lr = DEFAULT_LR.get(optimizer, DEFAULT_LR["sgd"]) if lr is None else lr
    out_dir = Path(out_dir).resolve()
    if not (out_dir / "plan.json").is_file():
        raise ConfigError(f"'{out_dir}' is not an autopart output directory (no plan.json); pass the -o of a compile")
    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    recipe.check(lr=lr, optimizer=optimizer)
    if not timeout_s > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {timeout_s:g}")
    plan = load_plan(out_dir / "plan.json")
    gpus = runs_on_gpus(plan)
    dropout = not _draws_apart_from_one_process(out_dir, plan)
    with tempfile.TemporaryDirectory(prefix="autopart-verify-") as folder:
        work = Path(folder)
        _run_distributed(out_dir, work, steps=steps, lr=lr, optimizer=optimizer, timeout_s=timeout_s, gpus=gpus,
                         recipe=recipe, dropout=dropout)
        records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
        finals = load_stage_weights(plan, work / "final")
    reference = train_reference(out_dir, steps=steps, lr=lr, optimizer=optimizer, device="cuda" if gpus else "cpu",
                                recipe=recipe, dropout=dropout, watch_buffers=True)
    bf16 = plan.dtype.startswith("bf16")
    initial = initial_weights(out_dir) if bf16 else {}
    noise = _bf16_noise(out_dir, reference.parameters, steps=steps, lr=lr, optimizer=optimizer, gpus=gpus,
                        recipe=recipe, dropout=dropout) if plan.dtype == "bf16" else {}  # fmt: skip
    # an order of sums is compared only where the draws are the same in every order of them
    adaptive = optimizer == "adamw" and not (dropout and _draws(out_dir))
    loss_atol, loss_rtol = BF16_LOSS_TOLERANCE if bf16 else LOSS_TOLERANCE
    order = _order_noise(out_dir, reference, plan, steps=steps, lr=lr, optimizer=optimizer, gpus=gpus, recipe=recipe,
                         dropout=dropout, loss_tolerance=(loss_atol, loss_rtol)) if adaptive else None  # fmt: skip
    losses = [r["loss"] for r in sorted(records, key=lambda r: r["step"])]
    failures = _unlisted_buffer_failures(reference)
    atol, rtol = PARAMETER_TOLERANCE
    loss_tolerance = f"{loss_atol:g} + {loss_rtol:g}*|loss|{', bf16' if bf16 else ''}{_reordered(order, '')}"
    reordered = _reordered(order, "each row's mean difference ")
    parameter_tolerance = (f"{BF16_SHARE_OF_STEP:g}*|its change in training| + 1e-07"
                           f"{f' + {BF16_NOISE_FACTOR:g}*|bf16 process - fp32 process|' if noise else ''}, bf16{reordered}"
                           if bf16 else f"{atol:g} + {rtol:g}*|value|{reordered}")
    loss_gaps = [float(_gap(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)))
                 for a, b in zip(losses, reference.losses)]
    for step, (gap, expected) in enumerate(zip(loss_gaps, reference.losses)):
        reordering = ORDER_NOISE_FACTOR * order.losses[step] if order is not None else 0.0
        if gap > max(float(_finite(loss_atol + loss_rtol * abs(expected))), float(_finite(reordering))):
            failures.append((gap, f"the loss of step {step} differs by {gap:.3g} ({losses[step]:.6f} vs {expected:.6f}; "
                                  f"tolerance {loss_tolerance})"))
    if len(losses) != steps:
        failures.append((float("inf"), f"the distributed run reported {len(losses)} losses for {steps} steps"))
    worst, worst_name = 0.0, ""
    for stage, weights in finals.items():
        for name, value in weights.items():
            if name not in reference.parameters:
                continue  # a constant of the graph, not a tensor of the model
            expected = reference.parameters[name]
            gap_tensor = _gap(_wide(value), _wide(expected))
            gap = float(gap_tensor.max()) if gap_tensor.numel() else 0.0
            if gap > worst:
                worst, worst_name = gap, name
            if bf16 and name in initial:
                moved = float((_wide(expected) - _wide(initial[name])).abs().max()) if expected.numel() else 0.0
                allowed = BF16_SHARE_OF_STEP * moved + 1e-7 + BF16_NOISE_FACTOR * noise.get(name, 0.0)
            else:
                allowed = atol + rtol * _wide(expected).abs()
            within = not bool((gap_tensor > _finite(allowed)).any())
            if not within and order is not None:  # AdamW: each row's mean, as far as the order of sums takes it
                within = order.covers(name, gap_tensor, noise.get(name))
            if not within:
                failures.append((gap, f"parameter {name} (stage {stage}) differs by up to {gap:.3g} "
                                      f"(tolerance {parameter_tolerance})"))
    failures.sort(key=lambda f: -f[0])
    loss_step = max(range(len(loss_gaps)), key=loss_gaps.__getitem__) if loss_gaps else 0
    return Verification(
        steps=steps, losses=losses, reference_losses=reference.losses, reference_parts=plan_parts(plan),
        loss_difference=max(loss_gaps, default=0.0), loss_step=loss_step,
        parameter_difference=worst, parameter=worst_name, failures=[text for _, text in failures],
        loss_tolerance=loss_tolerance, parameter_tolerance=parameter_tolerance, without_dropout=not dropout,
    )  # fmt: skip
