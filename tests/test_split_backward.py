"""The zero-bubble split of a stage's backward: I (input gradients) then W (weight gradients)
gives exactly the gradients of one full backward, and together they cost what it costs."""

import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autopart.runtime import collectives as tp
from autopart.runtime.backward import backward_full, backward_input, backward_weight
from tests.distributed import REPO, free_port


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


def test_the_input_half_keeps_what_the_forward_saved_until_the_weight_half():
    """What the memory model counts (`autopart.schedule.peaks`): a microbatch's activations
    live until its W, not its I, where the backward is split; W lets them go."""
    import gc
    import weakref

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    saved = []

    def pack(tensor):  # what the graph holds: a detached alias (a tensor itself would make a cycle with its node)
        alias = tensor.detach()
        saved.append(weakref.ref(alias))
        return alias

    inputs = [x.clone().requires_grad_(True)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = module(*inputs)
    made = list(saved)
    assert len(made) > 6, "the forward saved its activations"
    _, pending = backward_input([out], [torch.ones_like(out)], inputs, list(module.parameters()))
    del out
    gc.collect()
    assert sum(ref() is not None for ref in made) == len(made), "I keeps every saved activation"
    backward_weight(pending)
    del pending
    gc.collect()
    assert not any(ref() is not None for ref in made), "W lets them go"


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


class Gathered(nn.Module):
    """Two sequence-parallel column linears (``tp.gathered_linear``, one rank) over an input
    scaled by a weight below them, as a stage's normed input is."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(16, 8)
        self.scale = nn.Parameter(torch.rand(8) + 0.5)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, x, ids):
        h = self.embedding(ids) + (x * self.scale if x is not None else 0.0)
        return tp.gathered_linear(torch.tanh(tp.gathered_linear(h, self.fc.weight, self.fc.bias, 1)), self.head.weight,
                                  None, 1)  # fmt: skip


@pytest.fixture
def one_rank_group():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    tp.set_group(dist.group.WORLD)
    yield
    tp.set_group(None)
    if started:
        dist.destroy_process_group()


@pytest.mark.parametrize("receives", [True, False])  # False: a first stage's (no frontier: W runs it whole)
def test_a_gathered_linear_runs_each_collective_once_when_the_backward_is_split(one_rank_group, monkeypatch, receives):
    """Autograd runs a frontier node in I and again in W; ``tp.gathered_linear`` computes the
    input's gradient (its reduce-scatter) in I only and the weight's (its second gather) in W only,
    so a zero-bubble schedule pays each collective once, and the gradients are one backward's."""
    torch.manual_seed(0)
    module = Gathered()
    ids = torch.randint(0, 16, (2, 4))
    received = torch.randn(2, 4, 8)
    counted = {"_gather": 0, "_reduce_slice": 0}
    for name in counted:
        original = getattr(tp, name)

        def counting(*args, original=original, name=name):
            counted[name] += 1
            return original(*args)

        monkeypatch.setattr(tp, name, counting)
    results = []
    for split in (False, True):
        module.zero_grad(set_to_none=True)
        counted.update(_gather=0, _reduce_slice=0)
        x = received.clone().requires_grad_() if receives else None
        out = module(x, ids)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        if split:
            found, pending = backward_input([out], [grad], [x] if receives else [], list(module.parameters()))
            backward_weight(pending)
        else:
            found = backward_full([out], [grad], [x] if receives else [])
        assert counted == {"_gather": 4, "_reduce_slice": 2}, (split, counted)  # forward 2; backward each once
        results.append(({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}, found))
    (full, full_input), (split, split_input) = results
    assert set(split) == set(full) == {n for n, _ in module.named_parameters() if receives or n != "scale"}
    for name, grad in full.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    for full_grad, split_grad in zip(full_input, split_input, strict=True):
        torch.testing.assert_close(split_grad, full_grad, rtol=1e-6, atol=1e-7)
