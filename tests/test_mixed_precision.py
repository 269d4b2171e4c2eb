"""``--dtype bf16``: bf16 working weights cast once per step from fp32 master weights, gradients
accumulated in fp32, as Megatron-LM trains (`autopart.runtime.forward`); ``bf16-autocast`` keeps
torch.autocast over fp32 weights. In one process: what the stage forward casts and where the
gradients land; under real processes with gloo: pipelines (and pipeline x tensor parallelism)
train like one process in the same precision, and checkpoints, resume and ``consolidate`` keep
the fp32 master weights; and what the models predict of it."""


import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autopart

from autopart.driver import CompileOptions, compile_to_directory
from autopart.predict.memory import state_bytes
from autopart.runtime.forward import StageForward
from autopart.runtime.reference import train_reference
from autopart.tools.verify import verify
from tests.distributed import (FREE_LINKS, REPO, compile_and_train, read_metrics, run_cli_here, stage_weights,
                               train_whole_and_resumed)
from tests.test_recompute import wide_gpt

PSI = 1_000_000  # parameters


class _Casts(TorchDispatchMode):
    """Counts the dtype casts (``aten._to_copy``) run while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))


def _run_step(dtype: str, batches: list[torch.Tensor]) -> tuple[nn.Module, list[int], int]:
    """One step of two microbatches: the module, the casts each forward ran, the casts of begin_step."""
    module = _module()
    forward = StageForward(module, recompute="none", dtype=dtype, device=torch.device("cpu"), split_backward=False)
    with _Casts() as at_start:
        forward.begin_step()
    counts = []
    for x in batches:
        with _Casts() as casts:
            out, _ = forward(x)
        counts.append(casts.count)
        out.float().square().mean().backward()
    return module, counts, at_start.count


def test_bf16_casts_weights_once_per_step_and_accumulates_fp32_gradients():
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    module, counts, at_start = _run_step("bf16", batches)
    assert at_start == 4  # two weights and two biases, once for the step
    assert counts == [1, 1], "a forward casts only its input, never a weight"  # the input: fp32 in
    # the same mathematics by hand: bf16 copies, each microbatch's bf16 gradient summed in fp32
    expected = {name: torch.zeros_like(p) for name, p in module.named_parameters()}
    for x in batches:
        copies = {n: p.detach().to(torch.bfloat16).requires_grad_() for n, p in _module().named_parameters()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.func.functional_call(_module(), copies, (x,))
        out.float().square().mean().backward()
        for name, copy in copies.items():
            expected[name] += copy.grad.float()
    for name, p in module.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0, msg=name)
    _, autocast_counts, autocast_start = _run_step("bf16-autocast", batches)
    assert autocast_start == 0 and all(c >= 4 for c in autocast_counts), "autocast casts every weight per forward"


def test_memory_holds_a_bf16_working_copy_beside_fp32_masters():
    fp32 = 4 * PSI  # the plan's parameter bytes are the fp32 masters'
    assert state_bytes(fp32, optimizer="adamw", dp=1, zero=0, dtype="bf16") == 18 * PSI  # 2 + 4 + 4 + 8
    assert state_bytes(fp32, optimizer="adamw", dp=1, zero=0, dtype="bf16-autocast") == 16 * PSI
    # ZeRO-1 shards the fp32 masters too, the weights whole in bf16 (tests/test_distributed_optimizer.py)
    assert state_bytes(fp32, optimizer="adamw", dp=4, zero=1, dtype="bf16") == 6 * PSI + 12 * PSI // 4
    assert state_bytes(fp32, optimizer="sgd", dp=1, zero=0, dtype="bf16") == 10 * PSI


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "pp2xtp2"])
def test_bf16_pipeline_trains_like_one_bf16_process(tmp_path, tp):
    out = tmp_path / "out"
    plan, _ = compile_to_directory(
        CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, tp=tp, microbatches=2, micro_batch_size=2,
                       schedule="1f1b", dtype="bf16", device=str(FREE_LINKS)),
        out,
    )  # fmt: skip
    assert plan.dtype == "bf16" and plan.mesh["tp"] == tp
    # the embedding's bf16 working weight makes the residual stream bf16, as in Megatron-LM
    assert [meta.dtype for _, meta in plan.stages[1].inputs] == ["bfloat16"]
    result = verify(out, steps=2)
    assert result.matches, result.failures
    if tp == 1:  # the first step's loss is the same precision's, to float noise, and not autocast-over-fp32's
        # (at tp 2 the split matmuls' bf16 rounding moves the loss about as far as the two precisions lie
        # apart on this small model: 1.8e-5 against 2.4e-5 on one CPU, so only verify's tolerance holds there)
        same = train_reference(out, steps=1, lr=0.1, optimizer="sgd").losses[0]
        other = train_reference(out, steps=1, lr=0.1, optimizer="sgd", dtype="bf16-autocast").losses[0]
        assert abs(result.losses[0] - same) < 5e-6 and abs(same - other) > 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", [1, 2])
def test_bf16_with_zero_trains_as_without(tmp_path, zero):
    """ZeRO-1 steps fp32 master shards and broadcasts them before the next step's cast; ZeRO-2 lets
    FSDP2 gather bf16 weights and reduce-scatter fp32 gradients (MixedPrecisionPolicy). Against the
    same mesh without ZeRO (the same microbatches, so the same bf16 roundings), to fp32 noise."""
    runs = {z: compile_and_train(tmp_path / f"zero{z}", "gpt", pp=2, dp=2, zero=z, microbatches=2,
                                 micro_batch_size=1, schedule="1f1b", dtype="bf16", steps=2)
            for z in (0, zero)}  # fmt: skip
    assert runs[zero].plan.zero == zero and runs[zero].plan.dtype == "bf16"
    losses = {z: [m["loss"] for m in run.metrics] for z, run in runs.items()}
    torch.testing.assert_close(losses[zero], losses[0], rtol=1e-6, atol=1e-6)
    for stage, weights in runs[0].finals.items():
        for name, value in weights.items():
            assert runs[zero].finals[stage][name].dtype == torch.float32, name
            torch.testing.assert_close(runs[zero].finals[stage][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.multiprocess
def test_bf16_resume_is_bit_identical_and_consolidates_to_fp32_masters(tmp_path):
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", pp=2, microbatches=2, micro_batch_size=2,
                                        schedule="1f1b", dtype="bf16"), out)  # fmt: skip
    runs = train_whole_and_resumed(out, 2, tmp_path)
    whole, parts = (stage_weights(runs[n] / "final") for n in ("whole", "parts"))
    assert [m["loss"] for m in read_metrics(runs["whole"] / "metrics.jsonl")] == \
        [m["loss"] for m in read_metrics(runs["parts"] / "metrics.jsonl")]
    for stage, weights in whole.items():
        for name, value in weights.items():
            assert value.dtype == torch.float32, f"{name}: checkpoints hold the fp32 masters"
            assert torch.equal(parts[stage][name], value), name
    merged = tmp_path / "model.safetensors"
    result = run_cli_here("consolidate", str(runs["whole"] / "ckpt" / "step_00000004"), "-o", str(merged),
                          "--model", str(REPO / "examples" / "gpt.py"))
    assert result.returncode == 0, result.stderr
    state = load_file(str(merged))
    finals = {name: value for weights in whole.values() for name, value in weights.items()}
    for name, value in finals.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name


def test_bf16_is_priced_without_weight_casts_in_forward(tmp_path):
    """A wide GPT on the meta device, priced for an H100: ``bf16``'s forwards read bf16 weights
    (no cast of any weight, no per-microbatch 16-bit weight copy saved for backward) while its
    model state holds one bf16 copy more; ``bf16-autocast`` casts every weight in every forward."""
    model = wide_gpt(tmp_path, block_size=256, n_embd=2048)
    plans = {dtype: autopart.compile(model, micro_batch_size=1, microbatches=1, device="h100-sxm", dtype=dtype)
             for dtype in ("bf16", "bf16-autocast")}  # fmt: skip
    mixed, autocast = plans["bf16"].stages[0], plans["bf16-autocast"].stages[0]
    assert mixed.parameter_bytes == autocast.parameter_bytes, "the plan counts the fp32 masters"
    weights = mixed.parameter_bytes
    casts = weights / 4 * 6 / 3.35e12  # per weight read 4 bytes, write 2, at the H100's memory bandwidth
    assert autocast.forward_s - mixed.forward_s > 0.5 * casts
    assert autocast.activation_bytes - mixed.activation_bytes > 0.8 * weights / 2  # the saved copies
    memory = {dtype: plan.predicted.memory_bytes[0] for dtype, plan in plans.items()}
    assert memory["bf16"] - memory["bf16-autocast"] < weights / 2  # + P/2 working weights, - saved copies


@pytest.mark.parametrize("costs", [False, True], ids=["roofline", "profiled"])
def test_bf16_on_the_cpu_refuses_fp32_values_into_a_bf16_norm_weight_in_one_line(tmp_path, costs):
    """The same line whether annotate or the profiler (which runs the graph first) meets it."""
    profiled = ("--costs", str(tmp_path / "costs.json")) if costs else ()
    result = run_cli_here("compile", str(REPO / "tests" / "models" / "three_layers.py"), "-o", str(tmp_path / "out"),
                          "--dtype", "bf16", "--no-measure", *profiled)  # fmt: skip
    assert result.returncode == 2
    assert "at 'layer_norm'; compile with --dtype bf16-autocast" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


HALF_MODEL = """
import torch
def example_batch(b):
    return (torch.randn(b, 8),), torch.randn(b, 4)
def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output.float(), target)
class Half(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x.to(self.weight.dtype))
def build_model():
    return Half(8, 4).to({dtype})
"""


@pytest.mark.parametrize("dtype", ["torch.float16", "torch.float32"])
def test_a_model_built_in_half_precision_for_an_fp32_plan_is_warned(tmp_path, capsys, monkeypatch, dtype):
    """A ``.half()`` model in a plan of fp32 trained its fp16 parameters with no master copy and
    went to loss nan at step 1, where the plan said fp32, without a word."""
    from autopart.profiling.measure_defaults import NO_MEASURE_ENV
    from autopart.tools import cli

    model = tmp_path / "half.py"
    model.write_text(HALF_MODEL.format(dtype=dtype))
    # the default compile, which captures the model for its measurements and again to plan: one warning
    monkeypatch.delenv(NO_MEASURE_ENV)  # the suite's conftest turns measuring off
    cli.main(["compile", str(model), "-o", str(tmp_path / "out"), "--pp", "1", "--microbatches", "1"])
    warned = [line for line in capsys.readouterr().err.splitlines() if "without fp32 master weights" in line]
    if dtype == "torch.float32":
        assert warned == []
    else:
        assert len(warned) == 1 and warned[0].startswith("autopart: warning: build_model() of half.py gives float16 "
                                                         "parameters (first 'weight'), which train.py updates"), warned
