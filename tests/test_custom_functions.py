"""A model's own torch.autograd.Function: a traced graph keeps its forward and drops its backward
(`autopart.passes.custom_functions`), so one whose backward is its own is refused in one line,
with the --leaf that keeps it; one whose backward is its forward's derivative compiles."""

import re

import pytest

import autopart
from tests.distributed import run_cli

MODEL = """
import torch
from torch import nn


class Rounded(torch.autograd.Function):  # a straight-through estimator: round forward, identity backward
    @staticmethod
    def forward(ctx, x):
        return FORWARD

    @staticmethod
    def backward(ctx, grad):
        return BACKWARD


class Quantised(nn.Module):
    def forward(self, x):
        return Rounded.apply(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.q = Quantised()
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.q(self.a(x)))


def build_model():
    torch.manual_seed(0)
    return Model()


def example_batch(batch_size):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""

STRAIGHT_THROUGH = MODEL.replace("FORWARD", "x.round()").replace("BACKWARD", "grad")
DETACHED = MODEL.replace("FORWARD", "x.detach().round()").replace("BACKWARD", "grad")
SCALED = MODEL.replace("FORWARD", "x * 3").replace("BACKWARD", "grad * 3")  # the forward's derivative


@pytest.mark.parametrize("source", [STRAIGHT_THROUGH, DETACHED], ids=["straight_through", "detached"])
def test_a_function_with_a_backward_of_its_own_is_refused_with_the_leaf_that_keeps_it(tmp_path, source):
    """It trained with the gradient of round (zero everywhere) in silence, or, its forward
    detached, was refused as a loss that takes no gradient."""
    path = tmp_path / "model.py"
    path.write_text(source)
    with pytest.raises(autopart.AutopartError, match=r"^the model's autograd\.Function Rounded has a backward of its "
                                                     r"own, which a traced graph cannot keep .*; keep the module that "
                                                     r"calls it opaque with --leaf Quantised, or write its gradient "
                                                     r"with the forward's own ops \(a straight-through estimator: "
                                                     r"x \+ \(x\.round\(\) - x\)\.detach\(\)\)$"):
        autopart.compile(path, pp=2, microbatches=2, device="a100-80gb")
    plan = autopart.compile(path, pp=2, microbatches=2, device="a100-80gb", leaf="Quantised")
    assert plan.mesh["pp"] == 2


def test_a_function_whose_backward_is_its_forward_s_derivative_compiles(tmp_path):
    """Also in a bf16 model, whose two backward formulas round apart (it was refused)."""
    path = tmp_path / "model.py"
    path.write_text(SCALED)
    assert autopart.compile(path, pp=2, microbatches=2, device="a100-80gb").mesh["pp"] == 2
    silu = MODEL.replace("FORWARD", "x * torch.sigmoid(x)").replace(
        "BACKWARD", "grad * torch.sigmoid(ctx.saved_tensors[0]) * (1 + ctx.saved_tensors[0] * (1 - torch.sigmoid("
                    "ctx.saved_tensors[0])))").replace("    def forward(ctx, x):\n", "    def forward(ctx, x):\n"
                                                       "        ctx.save_for_backward(x)\n")
    path.write_text(silu.replace("return Model()", "return Model().to(torch.bfloat16)").replace(
        "torch.randn(batch_size, 8),), torch.randn(batch_size, 4)",
        "torch.randn(batch_size, 8, dtype=torch.bfloat16),), torch.randn(batch_size, 4, dtype=torch.bfloat16)"))
    assert autopart.compile(path, pp=2, microbatches=2, device="a100-80gb").mesh["pp"] == 2


@pytest.mark.parametrize("where", ["export", "loss_fn"])
def test_a_function_is_checked_whichever_capture_takes_the_model(tmp_path, where):
    """A forward that fx cannot trace goes to torch.export, and a loss_fn's Function is traced with
    the loss: both dropped the backward as fx does, in silence."""
    if where == "export":  # a branch on a shape, which fx cannot evaluate
        source = STRAIGHT_THROUGH.replace("return self.b(self.q(self.a(x)))",
                                          "h = self.a(x) if x.shape[0] > 1 else self.a(x) * 2\n"
                                          "        return self.b(self.q(h))")
    else:
        source = STRAIGHT_THROUGH.replace("return self.b(self.q(self.a(x)))", "return self.b(self.a(x))").replace(
            "    return nn.functional.mse_loss(output, target)", "    return nn.functional.mse_loss(Rounded.apply(output), target)")
    path = tmp_path / "model.py"
    path.write_text(source)
    with pytest.raises(autopart.AutopartError, match=r"^the model's autograd\.Function Rounded has a backward of its "
                                                     r"own, .*; write its gradient with the forward's own ops"):
        autopart.compile(path, pp=1, microbatches=2, device="a100-80gb")


@pytest.mark.multiprocess
def test_the_leaf_trains_with_the_function_s_own_backward(tmp_path):
    """Under --leaf the stages call the module, and torch runs the Function's backward: the
    programs match one process (whose gradients pass the rounding straight through)."""
    path = tmp_path / "model.py"
    path.write_text(STRAIGHT_THROUGH)
    out = tmp_path / "out"
    assert run_cli("compile", str(path), "-o", str(out), "--pp", "2", "--microbatches", "2", "--leaf", "Quantised",
                   "--device", "a100-80gb").returncode == 0
    result = run_cli("verify", str(out), "--steps", "2")
    assert result.returncode == 0 and re.search(r"match the original model", result.stdout), result.stdout + result.stderr
