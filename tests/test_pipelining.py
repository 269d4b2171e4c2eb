"""`autopart.runtime.pipelining`: a plan's stages as torch.distributed.pipelining objects, driven by
torch's own schedules from a loop of one's own (``examples/pipelining_loop.py``, its ranks forked),
train as the generated ``train.py`` does: the same losses, step by step."""

import re

import pytest
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from autopart.driver import CompileOptions, compile_to_directory
from autopart.runtime.pipelining import TORCH_SCHEDULES
from autopart.schedule import SCHEDULE_KINDS
from tests.distributed import FREE_LINKS, REPO, read_metrics, run_program, run_ranks, stage_weights

STEPS = 3


def test_every_schedule_kind_has_a_torch_class():
    assert set(TORCH_SCHEDULES) == set(SCHEDULE_KINDS)
    assert TORCH_SCHEDULES["gpipe"] is ScheduleGPipe and TORCH_SCHEDULES["1f1b"] is Schedule1F1B
    assert TORCH_SCHEDULES["interleaved"] is ScheduleInterleaved1F1B


def _compiled(tmp_path, source: str, **options):
    """(plan, out): the model file ``source``, as tmp_path/model.py, compiled into tmp_path/out."""
    path = tmp_path / "model.py"
    path.write_text(source)
    out = tmp_path / "out"
    plan, _ = compile_to_directory(CompileOptions(model=path, **options), out)
    return plan, out


def _example_losses(out, nproc: int, *more: str) -> list[float]:
    """The example's printed losses, its ranks forked as `run_ranks` forks train.py's (what it
    computes does not depend on the launcher; the README's torchrun line is the user's)."""
    result = run_program([str(REPO / "examples" / "pipelining_loop.py"), str(out), "--steps", str(STEPS), "--lr",
                          "1e-3", "--weight-decay", "0.1", *more], nproc, timeout=300)
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", result.stdout, re.MULTILINE)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "schedule, chunks, dp, tp",
    [("1f1b", 1, 1, 1), ("interleaved", 2, 1, 1), ("zb-h1", 1, 1, 1), ("zbv", 2, 1, 1), ("1f1b", 1, 2, 1), ("1f1b", 1, 1, 2)],
)
def test_the_example_loop_trains_as_train_py(tmp_path, schedule, chunks, dp, tp):
    out = tmp_path / "out"
    plan, _ = compile_to_directory(
        CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, dp=dp, tp=tp, microbatches=4, global_batch_size=8 * dp,
                       schedule=schedule, chunks=chunks, optimizer="adamw", device=str(FREE_LINKS)),
        out,
    )  # fmt: skip
    assert plan.tied_parameters, "gpt's tied head: the example sums its gradient over the stages"
    if tp > 1:
        assert any(stage.parameter_placements for stage in plan.stages), "weights split: collectives inside the stages"
    metrics = tmp_path / "metrics.jsonl"
    run_ranks(out, plan.world_size, "--steps", str(STEPS), "--lr", "1e-3", "--optimizer", "adamw",
              "--weight-decay", "0.1", "--metrics", str(metrics))  # fmt: skip
    expected = [m["loss"] for m in read_metrics(metrics)]
    assert _example_losses(out, plan.world_size) == pytest.approx(expected, abs=2e-6)  # printed to 6 decimals


def test_build_stages_needs_a_process_group(tmp_path):
    from autopart.ir.errors import ConfigError
    from autopart.runtime.pipelining import build_stages

    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=2, micro_batch_size=2), out)
    with pytest.raises(ConfigError, match="call torch.distributed.init_process_group first"):
        build_stages(out)


def test_build_stages_refuses_selective_recompute_under_a_zero_bubble_schedule(tmp_path):
    """torch's zero-bubble schedules take a stage's backward in two passes, which a selective
    checkpoint refuses in the middle of the first step ("backward once on any region computed
    under selective activation checkpoint"); build_stages says so before any group is made."""
    from autopart.ir.errors import ConfigError
    from autopart.runtime.pipelining import build_stages

    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=2, micro_batch_size=2,
                                        schedule="zb-h1", recompute="selective"), out)  # fmt: skip
    with pytest.raises(ConfigError, match=r"stage 0 recomputes selectively, which torch's ScheduleInterleavedZeroBubble "
                                          r"cannot run: .*; compile with --recompute full or none"):
        build_stages(out)


def test_the_batch_reaches_torch_s_stages_on_their_device(tmp_path):
    # torch's PipelineStage hands a step's keywords to the module as they are: the loop's batch,
    # drawn on the CPU, must be on the stages' device (a GPU's) before they run
    from types import SimpleNamespace

    import torch

    from autopart.runtime.mesh import Mesh
    from autopart.runtime.pipelining import Pipeline, ProcessGroups

    out = tmp_path / "out"
    plan, _ = compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=2,
                                                  micro_batch_size=2), out)
    pipeline = Pipeline(plan=plan, out_dir=out, coordinates=Mesh.of(plan).coordinates(1), modules={1: None},
                        stages=[SimpleNamespace(device=torch.device("meta"), is_last=True)], schedule_class=object,
                        groups=ProcessGroups(pp=None, tp=None, dp=None), tied=[], forwards=[], updates=[])
    inputs, target = next(pipeline.batches())
    keywords = pipeline.step_inputs(inputs, target)
    assert keywords and "target" in keywords
    assert all(value.device.type == "meta" for value in keywords.values() if isinstance(value, torch.Tensor))


def test_a_step_whose_buffer_updates_were_never_settled_is_refused_at_the_next(tmp_path):
    """A loop that leaves out ``reduce_gradients`` (a no-op at dp 1 without tied weights, before
    it settled the buffers) would train on with every updated buffer put back to the first step's
    start by each forward: the next step's inputs are refused in one line instead."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from autopart.ir.errors import ConfigError
    from autopart.runtime.buffer_updates import BufferUpdates
    from autopart.runtime.mesh import Mesh
    from autopart.runtime.pipelining import Pipeline, ProcessGroups

    out = tmp_path / "out"
    plan, _ = compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=2,
                                                  micro_batch_size=2), out)
    module = nn.Module()
    module.register_buffer("calls", torch.zeros(()))
    updates = BufferUpdates(module)
    pipeline = Pipeline(plan=plan, out_dir=out, coordinates=Mesh.of(plan).coordinates(1), modules={1: None},
                        stages=[SimpleNamespace(device=torch.device("cpu"), is_last=True)], schedule_class=object,
                        groups=ProcessGroups(pp=None, tp=None, dp=None), tied=[], forwards=[], updates=[updates])
    inputs, target = next(pipeline.batches())
    pipeline.step_inputs(inputs, target)
    with updates.forward():
        module.calls.add_(1)
    with pytest.raises(ConfigError, match=r"^the last step's buffer updates were not settled: call "
                                          r"pipeline\.reduce_gradients\(\) after each schedule\.step"):
        pipeline.step_inputs(inputs, target)
    updates.finish()
    assert float(module.calls) == 1.0 and pipeline.step_inputs(inputs, target)


def test_build_stages_makes_the_mesh_s_groups_with_the_timeout_given(tmp_path, monkeypatch):
    import datetime

    import torch.distributed as dist

    from autopart.runtime import pipelining
    from autopart.runtime.mesh import Mesh

    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=1, microbatches=2, micro_batch_size=2), out)
    asked = []

    def device_mesh(self, device_type, timeout=None):
        asked.append(timeout)
        raise LookupError("enough")

    monkeypatch.setattr(Mesh, "device_mesh", device_mesh)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(LookupError):
            pipelining.build_stages(out, timeout=datetime.timedelta(seconds=7))
    finally:
        dist.destroy_process_group()
    assert asked == [datetime.timedelta(seconds=7)]


def test_build_stages_refuses_weights_that_lack_a_tensor_in_one_line(tmp_path):
    """As train.py --weights does: a partial file ended in safetensors' own error inside load_stage."""
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from autopart.ir.errors import ConfigError
    from autopart.runtime.pipelining import build_stages

    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=1, microbatches=2, micro_batch_size=2), out)
    weights = load_file(str(out / "weights" / "stage_0.safetensors"))
    save_file({k: v for k, v in weights.items() if k != sorted(weights)[0]}, str(tmp_path / "partial.safetensors"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"lacks 1 tensor\(s\) of stage 0, first "):
            build_stages(out, weights=tmp_path / "partial.safetensors")
    finally:
        dist.destroy_process_group()


NORMED = """
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule, chunks, dp", [("1f1b", 1, 1), ("zbv", 2, 1), ("1f1b", 1, 2)])
def test_an_evaluation_between_steps_is_train_py_s(tmp_path, schedule, chunks, dp):
    """``schedule.eval`` after each step, as ``train.py --eval-every 1``: the same held-out losses
    (no dropout: the evaluation ran the captured graph's dropout), no autograd graph kept until the
    next step, one copy of each updated buffer at a time (two were), and the same buffers at the
    end. The rate is 0, so that the weights stay as they were and only what the evaluation keeps of
    the steps (BatchNorm's statistics) moves it; the loop's training draws and weights are
    checked beside train.py's by the dropout tests below. Under torch's V-shaped schedule an evaluation failed
    outright ("can't steal_bwd_input if this stage doesn't have backward")."""
    import json

    import torch


    path = tmp_path / "normed.py"
    path.write_text(NORMED)
    out = tmp_path / "out"
    plan, _ = compile_to_directory(CompileOptions(model=path, pp=2, dp=dp, chunks=chunks, microbatches=4,
                                                  micro_batch_size=2, schedule=schedule, measure=False), out)  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    run_ranks(out, plan.world_size, "--steps", "3", "--lr", "0", "--optimizer", "sgd", "--eval-every", "1",
              "--eval-batches", "1", "--metrics", str(metrics), "--save-weights", str(tmp_path / "final"))  # fmt: skip
    expected = [m["eval_loss"] for m in read_metrics(metrics)]
    result = run_program([str(REPO / "tests" / "pipelining_eval_rank.py"), str(out), "3", "0"], plan.world_size)
    printed = [float(x) for x in re.findall(r"^eval_loss (\S+)$", result.stdout, re.MULTILINE)]
    assert printed == pytest.approx(expected, rel=1e-6) and len(printed) == 3
    copies = re.findall(r"^copies (\d+) of (\d+)$", result.stdout, re.MULTILINE)
    assert copies and all(most == tracked for most, tracked in copies), copies
    assert set(re.findall(r"^graph kept (\w+)$", result.stdout, re.MULTILINE)) == {"False"}
    finals = {name: value for weights in stage_weights(tmp_path / "final").values() for name, value in weights.items()}
    buffers = {name: value for line in re.findall(r"^buffers (.*)$", result.stdout, re.MULTILINE)
               for name, value in json.loads(line).items()}
    assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for name, value in buffers.items():
        torch.testing.assert_close(torch.tensor(value, dtype=finals[name].dtype), finals[name], msg=name)


DROPPED = """
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(16, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule, recompute, dp", [("1f1b", "none", 1), ("zb-h1", "full", 2)])
def test_the_example_loop_draws_train_py_s_dropout(tmp_path, schedule, recompute, dp):
    """train.py seeds each forward from --seed, the step, the replica, the microbatch and the
    stage; the loop's stages drew from torch's generator as it stood, so with dropout its losses
    were not train.py's. A recompute (torch's W pass too) replays the forward's draws."""
    plan, out = _compiled(tmp_path, DROPPED, pp=2, dp=dp, microbatches=4, global_batch_size=8 * dp,
                          schedule=schedule, recompute=recompute, optimizer="adamw", measure=False)  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    run_ranks(out, plan.world_size, "--steps", str(STEPS), "--lr", "1e-3", "--optimizer", "adamw", "--seed", "3",
              "--weight-decay", "0.1", "--metrics", str(metrics))  # fmt: skip
    expected = [m["loss"] for m in read_metrics(metrics)]
    assert _example_losses(out, plan.world_size, "--seed", "3") == pytest.approx(expected, abs=2e-6)


@pytest.mark.multiprocess
def test_a_loop_without_reduce_gradients_draws_each_step_s_dropout(tmp_path):
    """The step of train.py's seed per forward is counted by the stages' own forwards: a loop
    with nothing to reduce may leave ``reduce_gradients`` out, and counted by it, every step drew
    the first step's masks. At rate 0 the loop's losses are train.py's, step by step."""
    plan, out = _compiled(tmp_path, DROPPED, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b", measure=False)
    assert not plan.tied_parameters
    metrics = tmp_path / "metrics.jsonl"
    run_ranks(out, plan.world_size, "--steps", "3", "--lr", "0", "--optimizer", "sgd", "--metrics", str(metrics))
    expected = [m["loss"] for m in read_metrics(metrics)]
    result = run_program([str(REPO / "tests" / "pipelining_no_reduce_rank.py"), str(out), "3"], plan.world_size)
    printed = [float(x) for x in re.findall(r"^loss (\S+)$", result.stdout, re.MULTILINE)]
    assert printed == pytest.approx(expected, rel=1e-6) and len(printed) == 3


def test_a_seed_train_py_would_refuse_is_refused_by_the_loop_too(tmp_path):
    """train.py's --seed lies within ±2**40 (its draws are 64-bit seeds made from it); past that the
    loop's batches failed deep in the batch generator."""
    from autopart.ir.errors import ConfigError
    from autopart.runtime.pipelining import build_stages

    with pytest.raises(ConfigError, match=r"the seed must lie between -2\*\*40 and 2\*\*40, got 4611686018427387904"):
        build_stages(tmp_path, seed=2**62)


@pytest.mark.multiprocess
def test_a_loop_resumed_at_a_step_draws_that_step_s_dropout_and_batch(tmp_path):
    """The example loop continuing a run from step 2's weights (``build_stages(first_step=2)``)
    trains steps 2 and 3 as one uninterrupted train.py does (SGD: the weights are its whole
    state); it drew step 0's dropout masks and batch again, where ``train.py --resume`` goes on
    with step 2's."""
    from safetensors.torch import save_file

    plan, out = _compiled(tmp_path, DROPPED, pp=2, microbatches=2, micro_batch_size=2, schedule="1f1b", measure=False)
    metrics = tmp_path / "metrics.jsonl"
    common = ("--lr", "0.1", "--optimizer", "sgd", "--seed", "3")  # each at its default decay: SGD's, none
    run_ranks(out, plan.world_size, "--steps", "4", *common, "--metrics", str(metrics))
    run_ranks(out, plan.world_size, "--steps", "2", *common, "--save-weights", str(tmp_path / "step2"))
    weights = tmp_path / "step2.safetensors"
    save_file({name: value for stage in stage_weights(tmp_path / "step2").values() for name, value in stage.items()},
              str(weights))
    result = run_program([str(REPO / "examples" / "pipelining_loop.py"), str(out), "--steps", "4", *common,
                          "--weights", str(weights), "--first-step", "2"], plan.world_size, timeout=300)  # fmt: skip
    printed = re.findall(r"^step (\d+) loss (\S+)$", result.stdout, re.MULTILINE)
    expected = [m["loss"] for m in read_metrics(metrics)]
    assert [int(step) for step, _ in printed] == [2, 3]
    assert [float(loss) for _, loss in printed] == pytest.approx(expected[2:], abs=2e-6)  # printed to 6 decimals


def test_a_first_step_below_zero_is_refused_in_one_line(tmp_path):
    from autopart.ir.errors import ConfigError
    from autopart.runtime.pipelining import build_stages

    with pytest.raises(ConfigError, match=r"first_step is the number of steps already trained, an integer 0 or more"):
        build_stages(tmp_path, first_step=-1)


TIED = """
import torch
from torch import nn


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


def build_model():
    torch.manual_seed(0)
    return Tied()


def example_batch(batch_size):
    return (torch.randint(0, 16, (batch_size, 4)),), torch.randint(0, 16, (batch_size, 4))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule, chunks, dp, reduce", [("1f1b", 1, 1, "each"), ("1f1b", 1, 1, "once"),
                                                        ("interleaved", 2, 2, "once"), ("zbv", 2, 1, "each")])
def test_gradients_accumulated_over_steps_are_one_process_s(tmp_path, schedule, chunks, dp, reduce):
    """Gradients accumulated over 3 ``schedule.step`` calls (with ``reduce_gradients`` after each,
    or once after the last, as DDP's no_sync) are the sum of the 3 batches' mean-loss gradients,
    as 3 ``loss.backward()`` calls in one process give: torch's ``scale_grads`` divided each
    step's whole ``.grad`` by the microbatches, the earlier steps' share again each time, and a
    tied weight's copies summed the earlier steps' sum again (or, reduced once, took the last
    step's alone). The second round begins from gradients zeroed in place, which hold no earlier
    step."""
    import itertools
    import json

    import torch

    from autopart.ir.model_file import load_model_file
    from autopart.runtime.data import global_batches
    from autopart.runtime.reference import initial_weights

    plan, out = _compiled(tmp_path, TIED, pp=2, dp=dp, microbatches=4, global_batch_size=8 * dp, schedule=schedule,
                          chunks=chunks, device="a100-80gb", measure=False)  # fmt: skip
    assert plan.tied_parameters == {"embed.weight": (0, len(plan.stages) - 1)}
    result = run_program([str(REPO / "tests" / "pipelining_accumulate_rank.py"), str(out), "3", reduce],
                         plan.world_size)
    spec = load_model_file(tmp_path / "model.py")
    model = spec.module
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in initial_weights(out).items():
            named[name].copy_(value)
    for inputs, target in itertools.islice(global_batches(spec, plan.schedule.global_batch_size, 0), 3, 6):
        spec.loss_fn(model(*inputs), target).backward()
    assert "refused pipeline.schedule() sets scale_grads itself" in result.stdout
    printed = [json.loads(line) for line in re.findall(r"^grads (.*)$", result.stdout, re.MULTILINE)]
    assert len(printed) == 2 and {name for grads in printed for name in grads} == set(named)
    for grads in printed:
        for name, grad in grads.items():
            torch.testing.assert_close(torch.tensor(grad), named[name].grad, msg=name)


@pytest.mark.multiprocess
def test_a_stage_whose_output_is_a_view_trains_under_torch_s_zero_bubble_schedules(tmp_path):
    """A stage that ends in a linear layer over 3-D activations returns a view (``F.linear``
    reshapes its 2-D product), and torch's zero-bubble schedules (``zb-h1``, ``zbv``) detach a
    stage's outputs in place after its input-gradient pass, which a view refuses: the loop failed
    at the first backward of such a middle stage ("Can't detach views in-place")."""
    plan, out = _compiled(tmp_path, TIED, pp=2, microbatches=4, global_batch_size=8, schedule="zbv", chunks=2,
                          optimizer="adamw", device="a100-80gb", measure=False)  # fmt: skip
    assert re.search(r"(\w+) = F\.linear\(.*\n\s+return \(\1,\)", (out / "stages" / "stage_1.py").read_text())
    metrics = tmp_path / "metrics.jsonl"
    run_ranks(out, plan.world_size, "--steps", str(STEPS), "--lr", "1e-3", "--optimizer", "adamw",
              "--weight-decay", "0.1", "--metrics", str(metrics))  # fmt: skip
    expected = [m["loss"] for m in read_metrics(metrics)]
    assert _example_losses(out, plan.world_size) == pytest.approx(expected, abs=2e-6)


@pytest.mark.multiprocess
def test_the_example_loop_trains_a_rank_without_parameters(tmp_path):
    """A cut may leave a stage the loss alone: its rank has no parameter, and the example's AdamW
    failed there with torch's "optimizer got an empty parameter list"; `parameter_groups` gives it
    one empty group, whose steps do nothing, as train.py's optimizer has."""
    out = tmp_path / "out"
    plan, _ = compile_to_directory(CompileOptions(model=REPO / "tests" / "models" / "one_linear.py", pp=2,
                                                  microbatches=2, global_batch_size=4, measure=False), out)  # fmt: skip
    assert plan.stages[-1].parameters == () and plan.stages[0].parameters
    metrics = tmp_path / "metrics.jsonl"
    run_ranks(out, plan.world_size, "--steps", str(STEPS), "--lr", "1e-3", "--optimizer", "adamw",
              "--weight-decay", "0.1", "--metrics", str(metrics))  # fmt: skip
    expected = [m["loss"] for m in read_metrics(metrics)]
    assert _example_losses(out, plan.world_size) == pytest.approx(expected, abs=2e-6)
