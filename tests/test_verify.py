"""autopart verify on the examples and on a corrupted stage file; names from the model in generated code."""

import ast
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import autopart
from autopart.codegen.names import plain_text
from autopart.driver import CompileOptions, compile_to_directory
from autopart.ir.errors import CaptureError
from autopart.ir.plan import load_plan
from autopart.runtime.reference import train_reference
from autopart.tools.verify import verify
from tests.distributed import REPO, run_cli, run_cli_here


def compiled(tmp_path: Path, example: str, dtype: str = "fp32") -> Path:
    out = tmp_path / example
    compile_to_directory(CompileOptions(model=REPO / "examples" / f"{example}.py", pp=2, microbatches=2,
                                        micro_batch_size=2, dtype=dtype, measure=False), out)  # fmt: skip
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("example, dtype", [("gpt", "fp32"), ("llama", "bf16")])
def test_verify_passes_on_the_examples(tmp_path, example, dtype):
    """A bf16 plan is held to bf16 tolerances against one bf16 process (fp32's would fail it).
    The fp32 one runs the command as a user does, in a process of its own."""
    command = run_cli if dtype == "fp32" else run_cli_here
    result = command("verify", str(compiled(tmp_path, example, dtype)), "--steps", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    printed = " ".join(result.stdout.split())
    # every verdict line shows the tolerance it applied: a bf16 plan's, not fp32's
    loss = "1e-05 + 0.016*|loss|, bf16" if dtype == "bf16" else "1e-05 + 1e-05*|loss|"
    parameters = ("0.02*|its change in training| + 1e-07 + 2*|bf16 process - fp32 process|, bf16" if dtype == "bf16"
                  else "1e-05 + 0.0001*|value|")
    assert "largest loss difference" in printed and f"tolerance {loss})" in printed
    assert f"tolerance {parameters})" in printed
    assert f"match the original model (losses within {loss}; parameters within {parameters})" in printed


@pytest.mark.multiprocess
def test_verify_names_the_parameter_of_a_corrupted_stage(tmp_path):
    out = compiled(tmp_path, "gpt")
    corrupt(out, "F.gelu(", "torch.relu(")  # an MLP's activation in the last stage
    result = run_cli_here("verify", str(out), "--steps", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    worst = re.search(r"largest parameter difference [0-9.e-]+ \(([^,]+),", result.stdout).group(1)
    assert re.search(rf"autopart: verify: parameter {re.escape(worst)} \(stage \d\) differs by up to", result.stderr)
    assert "the loss of step 0 differs" in result.stderr and "tolerance 1e-05 + 1e-05*|loss|" in result.stderr


@pytest.mark.multiprocess
def test_a_run_that_turns_to_nan_does_not_match(tmp_path):
    """A NaN compares false with every tolerance: a broken run whose losses and weights turn to
    NaN passed as a match."""
    out = compiled(tmp_path, "gpt")
    corrupt(out, "F.gelu(", "float('nan') * F.gelu(")
    result = verify(out, steps=2)
    assert not result.matches and result.loss_difference == math.inf and result.parameter_difference == math.inf
    assert "the loss of step 0 differs by inf" in result.failures[0] or "differs by up to inf" in result.failures[0]


@pytest.mark.multiprocess
def test_a_reference_that_turns_to_nan_does_not_match_a_finite_run(tmp_path, monkeypatch):
    """The other way round: the tolerance made of a NaN reference value is NaN, and no gap is
    above it. The reference is made NaN here (a model whose one process diverges and whose
    pipeline does not has no example small enough), the distributed run as it is."""
    from autopart.tools import verify as verifying

    out = compiled(tmp_path, "gpt")
    real = verifying.train_reference

    def diverged(*args, **kwargs):
        run = real(*args, **kwargs)
        return replace(run, losses=[math.nan] * len(run.losses),
                       parameters={name: torch.full_like(value, math.nan) for name, value in run.parameters.items()})

    monkeypatch.setattr(verifying, "train_reference", diverged)
    result = verify(out, steps=1)
    assert not result.matches and result.loss_difference == math.inf and result.parameter_difference == math.inf


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_verify_holds_adamw_to_what_the_order_of_sums_does(tmp_path, dtype):
    """AdamW steps an element whose gradient is within rounding of zero by about the rate, the
    way the order of the sums decides: at a rate of 0.1 a pipeline's elements end apart from one
    process's by far more than rounding, in every matrix. The plan matches as one process summing
    over other microbatches does; with one row of a weight left without its gradient, or a
    corrupted activation, it does not. In bf16 the order moves so many elements that a tensor's
    mean would hide the row (one in 176): each row is held to its own."""
    out = compiled(tmp_path, "llama", dtype)
    result = verify(out, steps=2, lr=0.1, optimizer="adamw")
    assert result.matches, result.failures
    assert result.parameter_difference > 1e-3  # a hundred times what the rounding tolerance allows
    assert "or, AdamW, each row's mean difference within 2x one process's summing in other orders" in (
        result.parameter_tolerance)
    source = (out / "stages" / "stage_1.py").read_text()
    weight = re.search(r"F\.linear\(\w+, ((?:self\.layers\[\d+\]|layer)\.feed_forward\.w1\.weight)\)", source).group(1)
    frozen = out.parent / "frozen"
    shutil.copytree(out, frozen)
    corrupt(frozen, weight, f"torch.cat([{weight}[:1].detach(), {weight}[1:]])")
    result = verify(frozen, steps=2, lr=0.1, optimizer="adamw")
    assert [f for f in result.failures if "feed_forward.w1.weight" in f] and not result.matches
    corrupt(out, "F.silu(", "torch.relu(")
    assert not verify(out, steps=2, lr=0.1, optimizer="adamw").matches


@pytest.mark.multiprocess
def test_verify_holds_adamw_on_a_tensor_parallel_plan_to_what_fp32_rounding_does(tmp_path):
    """Tensor-parallel ranks add their pieces of a product, where one process sums it whole: an
    order no count of microbatches repeats, which AdamW's steps of near-cancelling gradients
    spread over whole rows (at a rate of 0.1, differences of 1e-2 where SGD's are 1e-8). The plan
    matches as far as one fp32 process ends from fp64; with one row of a split weight left
    without its gradient, it does not. (Compiled for a100-80gb: its cuts and splits are the same
    on every machine.)"""
    out = tmp_path / "gpt"
    compile_to_directory(CompileOptions(model=REPO / "examples" / "gpt.py", tp=2, microbatches=2, micro_batch_size=2,
                                        device="a100-80gb"), out)  # fmt: skip
    source = (out / "stages" / "stage_0.py").read_text()
    split = re.search(r"F\.linear\(\w+, ((?:self\.h\[\d+\]|layer)\.mlp\.c_proj\.weight)\)[^\n]*\n(?:[^\n]*\n)?"
                      r"\s*\w+ = tp\.all_reduce", source)
    assert split, "the plan splits no MLP's second product over its ranks"
    result = verify(out, steps=3, lr=0.1, optimizer="adamw")
    assert result.matches, result.failures
    assert result.parameter_difference > 1e-3
    assert "or in fp64 (twice that difference)" in result.parameter_tolerance
    weight = split.group(1)
    corrupt(out, weight + ")", f"torch.cat([{weight}[:1].detach(), {weight}[1:]]))", stage_index=0)
    result = verify(out, steps=3, lr=0.1, optimizer="adamw")
    assert [f for f in result.failures if "mlp.c_proj.weight" in f] and not result.matches


def test_the_reference_sums_the_same_gradient_over_microbatches(tmp_path):
    """One process summing each step's gradient over equal parts of the batch trains the model
    the whole batch trains (to rounding): what `_order_noise` compares is the order alone."""
    out = compiled(tmp_path, "gpt")
    whole = train_reference(out, steps=2, lr=0.1, optimizer="sgd")
    parts = train_reference(out, steps=2, lr=0.1, optimizer="sgd", microbatches=4)
    assert parts.losses == pytest.approx(whole.losses, rel=1e-6)
    for name, value in whole.parameters.items():
        torch.testing.assert_close(parts.parameters[name], value, atol=1e-6, rtol=1e-5)
    assert any(not torch.equal(parts.parameters[n], v) for n, v in whole.parameters.items())  # summed otherwise


COUNTED_NORMALISED = """
import torch
from torch import nn


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.relu(self.fc(x))


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(Counted(), nn.BatchNorm1d(8), Counted(), nn.Linear(8, 4))


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)
"""


@pytest.mark.multiprocess
def test_verify_names_a_moving_buffer_that_no_stage_file_lists(tmp_path):
    """The reference moved the buffers the stage files list, the list under test: one they leave
    out moved once per forward in both, and a plan with batch statistics, whose reference runs one
    forward per microbatch, passed with a counter that advanced twice a step. The reference now
    finds the buffers that move by value."""
    path = tmp_path / "counted.py"
    path.write_text(COUNTED_NORMALISED)
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=path, pp=2, microbatches=2, micro_batch_size=2, measure=False), out)
    assert load_plan(out / "plan.json").batch_statistics  # the reference runs one forward per microbatch
    assert verify(out, steps=2).matches
    listing = next(p for p in (out / "stages").glob("stage_*.py") if "'2.calls', " in p.read_text() or
                   ", '2.calls'" in p.read_text())
    source = listing.read_text()
    listing.write_text(source.replace(", '2.calls'", "", 1) if ", '2.calls'" in source
                       else source.replace("'2.calls', ", "", 1))
    sign_again(out)
    result = run_cli_here("verify", str(out), "--steps", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert ("autopart: verify: buffer 2.calls moves in the model's forward, but no stage file lists it in "
            "updated_buffers" in " ".join(result.stderr.split())), result.stderr


def corrupt(out: Path, text: str, instead: str, *, stage_index: int = 1) -> None:
    """The stage's (by default the last of two) first ``text`` made ``instead``, signed as a
    compile would sign it (the ranks refuse a stage file that the plan does not know)."""
    stage = out / "stages" / f"stage_{stage_index}.py"
    source = stage.read_text()
    assert text in source
    stage.write_text(source.replace(text, instead, 1))
    sign_again(out)


def sign_again(out: Path) -> None:
    """Record the stage files as they are now in plan.json, and the new plan's hash in the weights."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from autopart.ir.plan import load_plan
    from autopart.runtime.launch import PLAN_HASH_KEY, file_sha256, plan_digest

    plan = load_plan(out / "plan.json")
    replace(plan, stage_sha256={name: file_sha256(out / name) for name in plan.stage_sha256}).save(out / "plan.json")
    for weights in (out / "weights").iterdir():
        with safe_open(str(weights), framework="pt") as handle:
            metadata = {**handle.metadata(), PLAN_HASH_KEY: plan_digest(out / "plan.json")}
        save_file(load_file(str(weights)), str(weights), metadata=metadata)


def test_plain_text_keeps_generated_comments_and_docstrings_closed():
    assert plain_text('blocks.my-block') == "blocks.my-block"
    assert plain_text('a"""\nimport os\\') == "a????import os?"


def test_unsafe_module_names_are_refused_before_tracing(tmp_path):
    model = tmp_path / "odd.py"
    model.write_text(ODD.format(key=repr('x"""\nimport os')))
    with pytest.raises(CaptureError, match="rename it"):
        autopart.compile(model, microbatches=1, micro_batch_size=2)


def test_quotes_in_the_model_file_name_stay_inside_the_docstrings(tmp_path):
    model = tmp_path / 'we"""ird.py'
    model.write_text(ODD.format(key=repr("my-block")))
    plan = autopart.compile(model, pp=2, microbatches=2, micro_batch_size=2)
    out = autopart.emit(plan, tmp_path / "out")
    for path in [*(out / "stages").glob("*.py"), out / "train.py"]:
        tree = ast.parse(path.read_text())
        assert "we???ird.py" in ast.get_docstring(tree)
    assert "'blocks.my-block.weight'" in (out / "stages" / "stage_0.py").read_text()


ODD = '''
import torch
from torch import nn


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({{{key}: nn.Linear(8, 8), "ok": nn.Linear(8, 8)}})

    def forward(self, x):
        for block in self.blocks.values():
            x = torch.relu(block(x))
        return x


def build_model():
    return Odd()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 8)


def loss_fn(output, target):
    return ((output - target) ** 2).mean()
'''


ROTATED = """
import torch
from torch import nn


class Rotated(nn.Module):
    def __init__(self, t=4, d=8):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, 4)
        angles = torch.outer(torch.arange(t).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))  # complex64, as Llama's

    def forward(self, x):
        h = self.a(x)
        h = torch.view_as_real(torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2)) * self.freqs_cis).flatten(2)
        return self.b(torch.tanh(h)).mean(1)


def build_model():
    torch.manual_seed(0)
    return Rotated()


def example_batch(batch_size):
    return (torch.randn(batch_size, 4, 8),), torch.randint(0, 4, (batch_size,))


def loss_fn(out, target):
    return nn.functional.cross_entropy(out, target)
"""


def _compiled_file(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(source)
    out = tmp_path / "out"
    compile_to_directory(CompileOptions(model=path, pp=2, microbatches=2, micro_batch_size=2, device="a100-80gb"), out)
    return out


def test_the_fp64_reference_keeps_a_complex_buffer_whole(tmp_path):
    """verify's fp64 run casts the real floating tensors alone: a rotary embedding's complex
    buffer cast to float64 lost its imaginary part, and trained another model."""
    out = _compiled_file(tmp_path, ROTATED)
    fp32 = train_reference(out, steps=1, lr=0.1, optimizer="adamw")
    fp64 = train_reference(out, steps=1, lr=0.1, optimizer="adamw", dtype="fp64")
    assert fp64.losses[0] == pytest.approx(fp32.losses[0], rel=1e-6)


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("error:Casting complex values to real")
def test_verify_holds_adamw_to_the_orders_alone_where_the_model_cannot_run_in_fp64(tmp_path):
    """A forward that makes an fp32 tensor of its own cannot run over fp64 weights: verify says so
    and holds the plan to the orders of sums, where it failed in a traceback. The complex buffer
    is compared whole (its imaginary part was dropped, with torch's warning)."""
    mixed = ROTATED.replace("h = self.a(x)", "h = self.a(x) @ torch.eye(8, dtype=torch.float32)")
    result = verify(_compiled_file(tmp_path, mixed), steps=2, optimizer="adamw")
    assert result.matches, result.failures
    assert "fp64" not in result.parameter_tolerance
