"""The zero-bubble split of a stage's backward: I (input gradients) then W (weight gradients)
gives exactly the gradients of one full backward, and together they cost what it costs."""

import importlib.util

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autopart.runtime.backward import backward_full, backward_input, backward_weight
from tests.distributed import REPO


def _gpt():
    spec = importlib.util.spec_from_file_location("autopart_test_gpt", REPO / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TiedTwice(nn.Module):
    """One weight in two layers, one after the other: two frontier nodes, one below the other."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8)

    def forward(self, x):
        return self.shared(torch.tanh(self.other(self.shared(x))))


class DirectAndDerived(nn.Module):
    """A weight used as it is and through an op of its own (W and 2·W)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return x @ self.weight + torch.relu(x) @ (self.weight * 2) * self.scale


class TwoOutputs(nn.Module):
    """A stage that sends two tensors, one of which does not depend on its input."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.free = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return self.linear(x), torch.sin(self.free)


class Embedding(nn.Module):
    """A first stage: it receives token ids, nothing to differentiate."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, idx):
        return (self.proj(self.wte(idx)),)


def _cases():
    gpt = _gpt()
    torch.manual_seed(0)
    block = gpt.Block(gpt.GPTConfig())
    return {
        "gpt-block": (block, [torch.randn(2, 32, 64)], []),
        "tied-twice": (TiedTwice(), [torch.randn(4, 8)], []),
        "direct-and-derived": (DirectAndDerived(), [torch.randn(4, 8)], []),
        "two-outputs": (TwoOutputs(), [torch.randn(4, 8)], []),
        "embedding": (Embedding(), [], [torch.randint(0, 16, (2, 5))]),
    }


def _run(module, received, batch, *, split: bool):
    module.zero_grad(set_to_none=True)
    inputs = [t.clone().requires_grad_(True) for t in received]
    out = module(*inputs, *batch)
    outputs = list(out) if isinstance(out, tuple) else [out]
    generator = torch.Generator().manual_seed(7)
    grads = [torch.randn(o.shape, generator=generator) for o in outputs]
    if split:
        found, pending = backward_input(outputs, grads, inputs, list(module.parameters()))
        assert all(p.grad is None for p in module.parameters()), "I must leave the weights alone"
        del outputs, out
        backward_weight(pending)
    else:
        found = backward_full(outputs, grads, inputs)
    return found, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", ["gpt-block", "tied-twice", "direct-and-derived", "two-outputs", "embedding"])
def test_input_then_weight_gradients_equal_one_backward(case):
    module, received, batch = _cases()[case]
    full_inputs, full_weights = _run(module, received, batch, split=False)
    split_inputs, split_weights = _run(module, received, batch, split=True)
    assert set(split_weights) == set(full_weights) == {n for n, _ in module.named_parameters()}
    for name, grad in full_weights.items():
        torch.testing.assert_close(split_weights[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    for full, split in zip(full_inputs, split_inputs, strict=True):
        torch.testing.assert_close(split, full, rtol=1e-6, atol=1e-7)


def test_weight_gradients_accumulate_over_microbatches():
    module, (x,), _ = _cases()["gpt-block"]
    module.zero_grad(set_to_none=True)
    pendings = []
    for m in range(2):  # both I halves first, then both W halves, as a deferring rank runs them
        inputs = [(x + m).requires_grad_(True)]
        out = module(*inputs)
        pendings.append(backward_input([out], [torch.ones_like(out)], inputs, list(module.parameters()))[1])
    for pending in pendings:
        backward_weight(pending)
    split = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    for m in range(2):
        module(x + m).sum().backward()
    for name, p in module.named_parameters():
        torch.testing.assert_close(split[name], p.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_split_costs_what_one_backward_costs():
    """W does not run I again: the FLOPs of I and W add up to those of B, and each is a real share."""
    module, (x,), _ = _cases()["gpt-block"]
    inputs = [x.clone().requires_grad_(True)]

    def flops(fn) -> int:
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    out = module(*inputs)
    full = flops(lambda: backward_full([out], [torch.ones_like(out)], inputs))
    out = module(*inputs)
    held = {}
    input_flops = flops(lambda: held.update(pending=backward_input([out], [torch.ones_like(out)], inputs,
                                                                  list(module.parameters()))[1]))
    weight_flops = flops(lambda: backward_weight(held["pending"]))
    assert input_flops + weight_flops == full
    assert 0.3 * full < weight_flops < 0.7 * full
