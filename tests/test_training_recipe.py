"""train.py's learning-rate schedules, weight decay by parameter, gradient clipping and held-out
evaluation: the rules in one process, then the programs under pp x dp and pp x tp against the
single-process reference (torch's LambdaLR and clip_grad_norm_ on the original model)."""

import math
import shutil
from pathlib import Path

import pytest
import torch

from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.errors import ConfigError
from autopart.ir.plan import load_plan
from autopart.runtime.recipe import Recipe, embedding_parameters, parameter_groups
from autopart.runtime.reference import train_reference
from autopart.runtime.shards import load_stage_weights
from tests.distributed import (
    FREE_LINKS, REPO, assert_same_training, compile_and_train, read_metrics, run_cli_here, run_ranks,
)

RECIPE = Recipe(lr_schedule="cosine", warmup_steps=1, min_lr=1e-4, clip_grad_norm=0.05, weight_decay=0.1)
STEPS = 4


@pytest.mark.parametrize(
    "schedule, factors",
    [
        ("constant", [1 / 3, 2 / 3, 1, 1, 1]),
        ("linear", [1 / 3, 2 / 3, 1, 0.55, 0.1]),  # to min_lr / lr = 0.1 at the last step
        ("cosine", [1 / 3, 2 / 3, 1, 0.1 + 0.9 * 0.5, 0.1]),
    ],
)
def test_lr_factor_warms_up_then_falls_to_min_lr_at_the_last_step(schedule, factors):
    factor = Recipe(lr_schedule=schedule, warmup_steps=2, min_lr=0.1).lr_factor(1.0, 5)
    assert [factor(s) for s in range(5)] == pytest.approx(factors)


def test_cosine_factor_is_half_a_cosine():
    factor = Recipe(lr_schedule="cosine").lr_factor(2.0, 9)
    assert [factor(s) for s in range(9)] == pytest.approx([0.5 * (1 + math.cos(math.pi * s / 8)) for s in range(9)])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"lr_schedule": "step"}, "unknown --lr-schedule 'step'"),
        ({"warmup_steps": -1}, "--warmup-steps must be at least 0"),
        ({"clip_grad_norm": 0.0}, "--clip-grad-norm must be a positive norm"),
        ({"weight_decay": -0.1}, "--weight-decay must be finite, at least 0"),
        ({"min_lr": -1.0}, "--min-lr must be a finite rate, at least 0"),
    ],
)
def test_a_recipe_out_of_range_is_a_config_error(options, message):
    with pytest.raises(ConfigError, match=message):
        Recipe(**options)


def test_decay_skips_biases_norms_and_every_name_of_a_tied_embedding():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt_example", REPO / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    with torch.device("meta"):
        model = gpt.build_model()
    tables = embedding_parameters(model)
    assert {"wte.weight", "wpe.weight"} <= set(tables)
    assert "lm_head.weight" in tables, "tied to wte: the same tensor, not decayed either"
    decayed, kept = parameter_groups(model.named_parameters(), weight_decay=0.1, embeddings=tables)
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 for p in decayed["params"])
    assert not {names[id(p)] for p in decayed["params"]} & set(tables)
    assert any(names[id(p)].endswith(".bias") for p in kept["params"])
    assert any(p.ndim == 1 and not names[id(p)].endswith(".bias") for p in kept["params"]), "norm weights"


def clip_factor(total_norm: float, max_norm: float) -> float:
    """What ``torch.nn.utils.clip_grad_norm_`` multiplies every gradient by, as a Python number: the
    reference of train.py's clipping, which computes it on the device."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def test_clip_factor_is_torchs():
    grads = [torch.randn(3, 4) * 5, torch.randn(7)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    assert total == pytest.approx(float(norm), rel=1e-6)
    torch.testing.assert_close(params[0].grad, grads[0] * clip_factor(total, 1.0))
    assert clip_factor(0.5, 1.0) == 1.0


@pytest.mark.parametrize("scale", [5.0, 1e-3], ids=["clipped", "under the norm"])
def test_clipping_reads_nothing_on_the_host_and_scales_as_the_python_factor(monkeypatch, scale):
    """clip_gradients takes the norm and scales on the device (a read would stop a GPU's host
    between the backward and the optimizer step): no value is read, and every gradient, of each
    dtype (a half one in fp32 arithmetic, a 0-d one), is what the factor as a Python number made."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from autopart.runtime.gradients import clip_gradients
    from autopart.runtime.mesh import Coordinates

    torch.manual_seed(0)
    module = torch.nn.ParameterDict({
        "w": torch.nn.Parameter(torch.zeros(3, 4)), "b": torch.nn.Parameter(torch.zeros(())),
        "h": torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16)),
        "d": torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)),
    })
    for p in module.parameters():
        p.grad = (torch.randn(p.shape) * scale).to(p.dtype)
    before = {n: p.grad.clone() for n, p in module.named_parameters()}
    plan = SimpleNamespace(zero=0, tied_parameters={}, stages=[SimpleNamespace(parameter_placements={})])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for read in ("item", "tolist", "__float__", "__bool__"):
            monkeypatch.setattr(torch.Tensor, read, lambda *a, read=read: pytest.fail(f"read on the host: {read}"))
        norm = clip_gradients({0: module}, plan, Coordinates(dp=0, pp=0, tp=0), 1.0)
        monkeypatch.undo()
    finally:
        dist.destroy_process_group()
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in before.values()))
    assert float(norm) == pytest.approx(total, rel=1e-6)
    factor = clip_factor(float(norm), 1.0)
    assert (factor < 1.0) == (scale > 1.0)
    for name, p in module.named_parameters():
        assert torch.equal(p.grad, before[name] * factor), name


def _train(tmp_path: Path, *, pp: int, tp: int, dp: int, zero: bool = False, eval_every: int = 0):
    out = tmp_path / "out"
    microbatches = 2 * pp
    plan, _ = compile_to_directory(
        CompileOptions(model=REPO / "examples" / "gpt.py", pp=pp, tp=tp, dp=dp, zero=zero, microbatches=microbatches,
                       global_batch_size=microbatches * dp, optimizer="adamw", device=str(FREE_LINKS)),
        out,
    )  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    evaluation = ["--eval-every", str(eval_every), "--eval-batches", "2"] if eval_every else []
    run_ranks(out, pp * tp * dp, "--steps", str(STEPS), "--lr", "1e-3", "--optimizer", "adamw", *RECIPE.train_args(),
              *evaluation, "--metrics", str(metrics), "--save-weights", str(tmp_path / "final"), timeout=400)
    return plan, out, read_metrics(metrics), load_stage_weights(plan, tmp_path / "final")


@pytest.mark.multiprocess
@pytest.mark.parametrize("pp, tp, dp, zero", [(2, 1, 2, False), (2, 2, 1, False), (1, 1, 2, True)])
def test_cosine_warmup_clipping_and_decay_train_like_one_process(tmp_path, pp, tp, dp, zero):
    """Losses, learning rates, held-out losses and final weights equal the reference's under pp x dp,
    pp x tp, and ZeRO-1 (where the schedule's rate must reach each replica's sharded optimizer)."""
    plan, out, metrics, finals = _train(tmp_path, pp=pp, tp=tp, dp=dp, zero=zero, eval_every=2)
    if pp > 1:
        assert plan.tied_parameters, "gpt's tied head: a parameter held by two stages, its norm counted once"
    if tp > 1:
        assert any(stage.parameter_placements for stage in plan.stages), "some weight is sharded"
    reference = train_reference(out, steps=STEPS, lr=1e-3, optimizer="adamw", recipe=RECIPE, eval_every=2,
                                eval_batch_count=2)
    losses = torch.tensor([m["loss"] for m in metrics], dtype=torch.float64)
    torch.testing.assert_close(losses, torch.tensor(reference.losses, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert all(m["grad_norm"] > RECIPE.clip_grad_norm for m in metrics), "the clipping bites at every step"
    lrs = [m["lr"] for m in metrics]
    factor = RECIPE.lr_factor(1e-3, STEPS)
    assert lrs == pytest.approx([1e-3 * factor(s) for s in range(STEPS)])
    evaluated = {m["step"]: m["eval_loss"] for m in metrics if "eval_loss" in m}
    assert set(evaluated) == {1, 3} == set(reference.eval_losses)
    for step, loss in evaluated.items():
        assert loss == pytest.approx(reference.eval_losses[step], rel=1e-5, abs=1e-6)
    # Adam divides by sqrt(v): an element whose gradient is at float-noise level moves by a noisy
    # fraction of one step, so parameters agree to 1% of a step (lr * 1e-2), as in test_pipeline_equivalence
    for weights in finals.values():
        for name, value in weights.items():
            torch.testing.assert_close(value, reference.parameters[name], rtol=1e-5, atol=1e-5, msg=name)
    assert all(m["tokens_per_s"] > 0 and m["tflops_per_device"] > 0 and 0 < m["mfu"] for m in metrics)


def test_the_plan_holds_the_models_flops_and_the_devices_peak():
    import autopart

    plan = autopart.compile(REPO / "examples" / "gpt.py", microbatches=2, micro_batch_size=2, device="h100-sxm",
                            dtype="bf16")  # fmt: skip
    assert plan.predicted.peak_flops == 989e12
    parameters = sum(stage.parameter_bytes for stage in plan.stages) / 4
    tokens = plan.schedule.global_batch_size * 32  # gpt's block_size
    # 6 N T: the matrix products' forward and backward (attention's and the embeddings' aside)
    assert 0.5 < plan.predicted.model_flops_per_step / (6 * parameters * tokens) < 3


def test_tensorboard_without_the_package_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    from autopart.runtime.progress import check_tensorboard

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="--tensorboard needs the tensorboard package"):
        check_tensorboard(tmp_path)


def test_verify_takes_the_recipe_flags():
    result = run_cli_here("verify", "--help")
    assert "--clip-grad-norm" in result.stdout and "--lr-schedule" in result.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule, chunks", [("zb-h1", 1), ("interleaved", 2)])
def test_evaluation_runs_the_forwards_of_any_schedule(tmp_path, schedule, chunks):
    """The held-out loss, forward only through split-backward and interleaved schedules, is the
    reference's; SGD with the recipe: parameters to fp32 tolerance."""
    run = compile_and_train(tmp_path, "gpt", pp=2, microbatches=4, schedule=schedule, chunks=chunks, steps=2,
                            train_args=("--eval-every", "1", "--eval-batches", "2", *RECIPE.train_args()))
    reference = train_reference(run.out, steps=2, lr=0.1, optimizer="sgd", recipe=RECIPE, eval_every=1,
                                eval_batch_count=2)
    assert [m["eval_loss"] for m in run.metrics] == pytest.approx([reference.eval_losses[s] for s in range(2)],
                                                                  rel=1e-5, abs=1e-6)  # fmt: skip
    assert_same_training(run, optimizer="sgd", lr=0.1, recipe=RECIPE)


@pytest.mark.multiprocess
def test_a_resumed_run_continues_the_schedule(tmp_path):
    """Stopped after step 2 and resumed with the same --steps, the rate goes on where it was:
    bit-identical to one run."""
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=2, micro_batch_size=2,
                                        optimizer="adamw"), out)  # fmt: skip
    folders = {name: tmp_path / name for name in ("whole", "parts")}

    def train(folder: Path, steps: int, *extra: str):
        folder.mkdir(exist_ok=True)
        return run_ranks(out, 2, "--steps", str(steps), "--optimizer", "adamw", "--lr", "0.01", *RECIPE.train_args(),
                  "--metrics", str(folder / "metrics.jsonl"), "--checkpoint-dir", str(folder / "ckpt"), *extra)

    train(folders["whole"], 4)
    train(folders["parts"], 3, "--checkpoint-every", "2")
    shutil.rmtree(folders["parts"] / "ckpt" / "step_00000003")  # as if it died after reporting step 2
    notes = train(folders["parts"], 4, "--resume").stderr
    assert "step_00000002 was saved by a run with --steps 3 (now 4); the training recipe follows the flags given now" in notes
    assert f"dropped 1 records of steps 2 on from {folders['parts'] / 'metrics.jsonl'}" in " ".join(notes.split())
    resumed, whole = read_metrics(folders["parts"] / "metrics.jsonl"), read_metrics(folders["whole"] / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [0, 1, 2, 3], "each step once: the resumed run's records replace step 2's"
    assert [(m["lr"], m["loss"]) for m in resumed[2:]] == [(m["lr"], m["loss"]) for m in whole[2:]]


def test_a_resume_is_told_the_recipe_flags_that_changed_and_steps_only_where_both_runs_decayed():
    from autopart.runtime.recipe import Recipe

    constant, cosine = Recipe(lr_schedule="constant"), Recipe(lr_schedule="cosine")
    assert Recipe.changed_flags(constant.flags(0.1, 4), constant.flags(0.1, 6)) == []
    assert Recipe.changed_flags(constant.flags(0.1, 4), cosine.flags(0.1, 6)) == ["--lr-schedule constant (now cosine)"]
    assert Recipe.changed_flags(cosine.flags(0.1, 4), cosine.flags(0.2, 6)) == ["--lr 0.1 (now 0.2)", "--steps 4 (now 6)"]
    decayed = Recipe(lr_schedule="constant", weight_decay=0.1)
    assert Recipe.changed_flags(constant.flags(0.1, 4), decayed.flags(0.1, 4)) == ["--weight-decay (not given) (now 0.1)"]


@pytest.mark.multiprocess
def test_verify_applies_the_recipe(tmp_path):
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=2,
                                        micro_batch_size=2), out)  # fmt: skip
    result = run_cli_here("verify", str(out), "--steps", "3", *RECIPE.train_args())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "match the original model" in " ".join(result.stdout.split())


def test_eval_batches_come_from_the_model_file_when_it_has_them(tmp_path):
    from autopart.ir.model_file import load_model_file
    from autopart.runtime.data import eval_batches, global_batches

    model = tmp_path / "model.py"
    model.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Linear(3, 1)\n"
        "def example_batch(b):\n    return (torch.zeros(b, 3),), torch.zeros(b, 1)\n"
        "def loss_fn(out, target):\n    return ((out - target) ** 2).mean()\n"
        "def eval_batches(b, seed):\n    for i in range(2):\n"
        "        yield (torch.full((b, 3), float(i + seed)),), torch.zeros(b, 1)\n"
    )  # fmt: skip
    spec = load_model_file(model, build=False)
    batches = eval_batches(spec, 4, 10, 2)
    assert [float(inputs[0][0, 0]) for inputs, _ in batches] == [10.0, 11.0]
    with pytest.raises(ConfigError, match="gave 2 batches but --eval-batches is 3"):
        eval_batches(spec, 4, 10, 3)
    spec = load_model_file(REPO / "examples" / "gpt.py", build=False)
    held_out, training = next(iter(eval_batches(spec, 2, 0, 1))), next(global_batches(spec, 2, 0))
    assert not torch.equal(held_out[0][0], training[0][0]), "synthetic held-out batches are not the training ones"


def test_held_out_batches_are_drawn_afresh_for_each_evaluation_and_not_kept(tmp_path):
    """--eval-batches may be more than memory holds: each evaluation draws its batches again (the
    same ones), and none is kept between evaluations."""
    from autopart.ir.model_file import load_model_file
    from autopart.runtime.data import eval_batches

    model = tmp_path / "model.py"
    model.write_text(
        "import itertools, torch\n"
        "DRAWN = [0]\n"
        "def build_model():\n    return torch.nn.Linear(3, 1)\n"
        "def example_batch(b):\n    return (torch.zeros(b, 3),), torch.zeros(b, 1)\n"
        "def eval_batches(b, seed):\n    for i in itertools.count():\n        DRAWN[0] += 1\n"
        "        yield (torch.randn(b, 3),), torch.zeros(b, 1)\n"
    )  # fmt: skip
    spec = load_model_file(model, build=False)
    drawn = spec.eval_batches.__globals__["DRAWN"]
    held_out = eval_batches(spec, 4, 0, 5)
    assert len(held_out) == 5 and drawn[0] == 5, "counted once before training"
    first, second = list(held_out), list(held_out)
    assert drawn[0] == 15, "each evaluation draws its batches again"
    assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(first, second)), "the same batches each time"
    assert not any(isinstance(v, (list, tuple)) for v in vars(held_out).values()), "no batches kept"


def test_tensorboard_gets_every_scalar(tmp_path, monkeypatch):
    import sys
    import types

    from autopart.runtime.progress import StepReporter, Throughput

    written: list[tuple[str, float, int]] = []

    class Writer:
        def __init__(self, folder, purge_step=None):
            assert folder == str(tmp_path)
            written.append(("purge_step", purge_step, 0))

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def close(self):
            written.append(("closed", 0, 0))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    metrics = tmp_path / "logs" / "m.jsonl"  # in a folder not made yet: the run makes it, not its first step's crash
    reporter = StepReporter(steps=2, seconds=None, first_step=0, metrics=metrics, tensorboard=tmp_path)
    reporter.step({"step": 0, "loss": 2.0, "step_s": 0.5, "lr": 1e-3, "eval_loss": 2.5},
                  Throughput(tokens_per_s=10.0, tflops_per_device=1.0, mfu=0.25))  # fmt: skip
    reporter.close()
    tags = {tag: value for tag, value, _ in written}
    assert tags["train/loss"] == 2.0 and tags["eval/loss"] == 2.5 and tags["train/mfu"] == 0.25 and "closed" in tags
    assert read_metrics(metrics)[0]["tokens_per_s"] == 10.0
    assert tags["purge_step"] is None, "a run that resumes nothing keeps the event files whole"
    StepReporter(steps=9, seconds=None, first_step=4, metrics=None, tensorboard=tmp_path, resumed=True).close()
    assert written[-2] == ("purge_step", 4, 0), "a resumed run's tensorboard forgets the steps it trains again"


def test_the_progress_bar_counts_to_steps_and_without_a_total_where_the_run_stops_on_time():
    from autopart.runtime.progress import StepReporter

    totals = []
    for seconds in (None, 5.0):
        reporter = StepReporter(steps=100, seconds=seconds, first_step=3, metrics=None, tensorboard=None)
        task = reporter.progress.tasks[0]
        totals.append((task.total, task.completed))
        reporter.close()
    assert totals == [(100, 3), (None, 3)]


def test_tokens_are_the_token_ids_else_the_samples():
    from autopart.runtime.progress import tokens_in

    assert tokens_in((torch.zeros(4, 32, dtype=torch.long),)) == 128
    assert tokens_in((torch.zeros(4, 3),)) == 4


MOMENTUM = Recipe(momentum=0.9, nesterov=True, clip_grad_norm=0.5, weight_decay=0.01)


@pytest.mark.parametrize("name, options, torchs", [
    ("sgd", {"momentum": 0.9, "nesterov": True}, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
    ("adamw", {"betas": (0.8, 0.95)}, lambda p: torch.optim.AdamW(p, lr=0.1, betas=(0.8, 0.95))),
])
def test_sgd_momentum_and_adamw_betas_step_as_torchs(name, options, torchs):
    from autopart.runtime.optim import make_optimizer
    from tests.distributed import replica_model

    ours, theirs = replica_model(), replica_model()
    optimizer = make_optimizer(name, ours.parameters(), 0.1, **options)
    plain = torchs(theirs.parameters())
    for step in range(3):
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for model, opt in ((ours, optimizer), (theirs, plain)):
            model(batch).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for mine, torchs in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(mine, torchs, rtol=0, atol=0)
    assert optimizer.state and all(state for state in optimizer.state.values())


@pytest.mark.parametrize("make, message", [
    (lambda: Recipe(momentum=0.9).check(lr=0.1, optimizer="adamw"), "--momentum is SGD's, and --optimizer is adamw"),
    (lambda: Recipe(nesterov=True), "--nesterov is a kind of momentum"),
    (lambda: Recipe(momentum=-0.5), "--momentum must be finite, at least 0"),
    (lambda: Recipe(betas=(0.9, 0.95)).check(lr=0.1, optimizer="sgd"), "--betas are AdamW's, and --optimizer is sgd"),
    (lambda: Recipe(betas=(0.9, 1.0)), r"--betas must be two rates in \[0, 1\), got 0.9,1"),
])
def test_momentum_or_betas_for_the_other_optimizer_or_out_of_range_is_a_config_error(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", [1, 3])
def test_sgd_momentum_trains_like_torchs_and_resumes_with_its_buffers(tmp_path, zero):
    """--momentum 0.9 --nesterov under pp x dp with the momentum buffers sharded (ZeRO-1) or the
    parameters too (ZeRO-3): the final weights are torch.optim.SGD's on the original model, and a
    run stopped after 2 steps and resumed ends where one run of 4 ends, the buffers restored."""
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=REPO / "tests" / "models" / "tiny_gpt.py", pp=2, dp=2, zero=zero,
                                        microbatches=2, micro_batch_size=1, optimizer="sgd", measure=False), out)
    finals = {}
    for name, steps in (("whole", ["4"]), ("parts", ["2", "4"])):
        for count in steps:
            run_ranks(out, 4, "--steps", count, "--lr", "0.1", *MOMENTUM.train_args(), "--save-weights",
                      str(tmp_path / name), "--checkpoint-dir", str(tmp_path / f"{name}-ckpt"),
                      *(["--resume"] if count == "4" and name == "parts" else []), timeout=400)
        finals[name] = {k: v for stage in load_stage_weights(load_plan(out / "plan.json"), tmp_path / name).values()
                        for k, v in stage.items()}
    reference = train_reference(out, steps=4, lr=0.1, optimizer="sgd", recipe=MOMENTUM)
    for name, value in finals["whole"].items():
        torch.testing.assert_close(finals["parts"][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(value, reference.parameters[name], rtol=1e-5, atol=1e-6, msg=name)



@pytest.mark.multiprocess
def test_adamw_betas_train_like_torchs(tmp_path):
    """--betas 0.8,0.95 under pp 2 with the recipe's schedule and clipping: torch.optim.AdamW's betas."""
    recipe = Recipe(betas=(0.8, 0.95), clip_grad_norm=0.5, lr_schedule="cosine", warmup_steps=1)
    run = compile_and_train(tmp_path, REPO / "tests" / "models" / "tiny_gpt.py", pp=2, microbatches=2, schedule="1f1b",
                            optimizer="adamw", lr=1e-2, steps=4, train_args=tuple(recipe.train_args()), measure=False)
    assert_same_training(run, optimizer="adamw", lr=1e-2, recipe=recipe, param_atol=1e-5)
    default = train_reference(run.out, steps=4, lr=1e-2, optimizer="adamw", recipe=Recipe(clip_grad_norm=0.5,
                              lr_schedule="cosine", warmup_steps=1))
    assert any(not torch.allclose(default.parameters[name], value, atol=1e-4)
               for stage in run.finals.values() for name, value in stage.items()), "the betas changed the training"


@pytest.mark.parametrize("optimizer, momentum, said", [
    ("adamw", 0.0, "--optimizer adamw keeps two fp32 moments per parameter that the plan, compiled for --optimizer "
                   "sgd, does not count in its memory; compile with --optimizer adamw to plan for them"),
    ("sgd", 0.9, "--momentum keeps an fp32 buffer per parameter that the plan, compiled for --optimizer sgd, does "
                 "not count in its memory"),
    ("sgd", 0.0, None),
])
def test_optimizer_state_the_plan_did_not_count_is_noted_once(capsys, optimizer, momentum, said):
    import argparse
    import types

    from autopart.runtime.train_flags import note_optimizer_state

    args = argparse.Namespace(optimizer=optimizer, momentum=momentum)
    for rank in (0, 1):
        note_optimizer_state(args, types.SimpleNamespace(optimizer="sgd"), rank)
    note_optimizer_state(args, types.SimpleNamespace(optimizer="adamw"), 0)  # a plan that counts two buffers
    lines = capsys.readouterr().err.splitlines()
    assert lines == ([] if said is None else [lines[0]]) and (said is None or said in lines[0]), lines
