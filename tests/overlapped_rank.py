"""One rank of tests/test_overlapped.py: the overlapped sequence-parallel linears give what the
plain ones give (``tp.gathered_linear``; ``tp.reduce_scatter`` of a linear), forward and backward,
in fp32 and under bf16 autocast, for every number of pieces the slice allows, and with the
backward split into I and W as a zero-bubble schedule runs it. Under autocast a gathered linear
gathers its fp32 input as the bf16 its product reads, never the fp32 (half the bytes), and so does
the gather that several products read (``tp.gather_for_products``), and without sequence
parallelism the sum of their gradients (``tp.copy_for_products``)."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn import functional as F

from autopart.runtime import collectives as tp
from autopart.runtime import overlapped
from autopart.runtime.backward import backward_input, backward_weight

dist.init_process_group("gloo")
rank, t = dist.get_rank(), dist.get_world_size()
tp.set_group(dist.group.WORLD)
rows = int(sys.argv[1])  # a rank's slice of the sequence
started = {"_start_gather": 0, "_start_reduce_scatter": 0}  # collectives, counted: a split backward starts no more
for _name in started:
    def _counting(*args, _original=getattr(overlapped, _name), _name=_name):
        started[_name] += 1
        return _original(*args)

    setattr(overlapped, _name, _counting)


gathered_dtypes = []  # of every all-gather's tensors


_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # tp.all_gathered's


def _recording(out, tensor, *args, _original=getattr(dist, _GATHER), **kwargs):
    gathered_dtypes.append(tensor.dtype)
    return _original(out, tensor, *args, **kwargs)


setattr(dist, _GATHER, _recording)
scattered_dtypes = []  # of every reduce-scatter's tensors, in tp's own collectives


def _recording_scatter(out, whole, _original=tp.reduce_scatter_into, **kwargs):
    scattered_dtypes.append(whole.dtype)
    return _original(out, whole, **kwargs)


tp.reduce_scatter_into = _recording_scatter
reduced_dtypes = []  # of every all-reduce's tensors


def _recording_reduce(tensor, *args, _original=dist.all_reduce, **kwargs):
    reduced_dtypes.append(tensor.dtype)
    return _original(tensor, *args, **kwargs)


dist.all_reduce = _recording_reduce


def gathers_in(dtype, fn, *args):
    """``fn(*args)``, checking that every tensor it all-gathers is of ``dtype``."""
    gathered_dtypes.clear()
    result = fn(*args)
    assert gathered_dtypes and set(gathered_dtypes) == {dtype}, gathered_dtypes
    return result


def saved_slices(fn, shard, *rest):
    """The dtypes of the tensors of the slice's shape that ``fn`` saves for backward under autocast."""
    dtypes = []

    def pack(tensor):
        if tensor.shape == shard.shape:
            dtypes.append(tensor.dtype)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), torch.autocast("cpu", torch.bfloat16):
        fn(shard, *rest)
    return dtypes


def collectives_of(fn, *args):
    before = dict(started)
    result = fn(*args)
    return result, {k: started[k] - before[k] for k in started}


def leaves(*tensors):
    return [x.detach().clone().requires_grad_() for x in tensors]


def run(fn, inputs, grad_out, autocast, split=False):
    """The output and the gradients of ``inputs`` (the first an activation, the rest weights)."""
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = fn(*inputs)
    if not split:
        out.backward(grad_out.to(out.dtype))
        return out.detach(), [x.grad for x in inputs]
    found, pending = backward_input([out], [grad_out.to(out.dtype)], inputs[:1], inputs[1:])
    assert all(w.grad is None for w in inputs[1:]), "I left the weights alone"
    backward_weight(pending)
    return out.detach(), [found[0], *(w.grad for w in inputs[1:])]


for autocast in (False, True):
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else {}
    for chunks in [k for k in range(1, t + 1) if rows % k == 0]:
        torch.manual_seed(rank)  # each rank its own slice and weights: a wrong pairing shows
        shard, weight, bias = torch.randn(2, rows, 6), torch.randn(10, 6), torch.randn(10)
        grad_out = torch.randn(2, rows * t, 10)
        moved = torch.bfloat16 if autocast else torch.float32  # what the products read
        plain = gathers_in(moved, run, lambda x, w, b: tp.gathered_linear(x, w, b, 1), leaves(shard, weight, bias),
                           grad_out, autocast)
        unfused = run(lambda x, w, b: F.linear(tp.gather_from_sequence(x, 1), w, b), leaves(shard, weight, bias),
                      grad_out, autocast)
        torch.testing.assert_close(plain[0], unfused[0], rtol=0, atol=0)  # cast, then gathered: the same values
        counts = []
        for split in (False, True):
            piecewise, count = gathers_in(moved, collectives_of, run,
                                          lambda x, w, b: overlapped.gathered_linear(x, w, b, 1, chunks),
                                          leaves(shard, weight, bias), grad_out, autocast, split)
            counts.append(count)
            torch.testing.assert_close(piecewise[0], plain[0], **tolerance)
            for name, got, want in zip(("shard", "weight", "bias"), piecewise[1], plain[1]):
                torch.testing.assert_close(got, want, **tolerance,
                                           msg=lambda m, name=name: f"gathered_linear {chunks} pieces {split=}, {name}: {m}")

        # several products reading one gather (q, k and v of a Llama layer's normed input): it
        # moves, and its gradient is reduce-scattered, as the bf16 they read; they read the values
        # the gather of the fp32 gives them, and its gradient comes back in fp32
        def three_products(gather):
            def fn(x, *weights):
                whole = gather(x, 1)
                return torch.cat([F.linear(whole, w) for w in weights], -1)
            return fn

        weights, grad_three = [torch.randn(10, 6) for _ in range(3)], torch.randn(2, rows * t, 30)
        scattered_dtypes.clear()
        moved_once = gathers_in(moved, run, three_products(tp.gather_for_products), leaves(shard, *weights), grad_three,
                                autocast)
        assert scattered_dtypes == [moved], scattered_dtypes
        reference = run(three_products(tp.gather_from_sequence), leaves(shard, *weights), grad_three, autocast)
        torch.testing.assert_close(moved_once[0], reference[0], rtol=0, atol=0)
        for got, want in zip(moved_once[1], reference[1]):  # the gradient's partials summed in bf16:
            assert got.dtype == want.dtype and (got - want).norm() <= 1e-2 * want.norm()  # to its precision

        # without sequence parallelism the products read the whole input (``copy_to_tp``): its
        # gradient, partial on each rank, is summed as the bf16 they send back
        whole = torch.randn(2, rows * t, 6)
        reduced_dtypes.clear()
        copied = run(three_products(lambda x, dim: tp.copy_for_products(x)), leaves(whole, *weights), grad_three, autocast)
        assert reduced_dtypes == [moved], reduced_dtypes
        reference = run(three_products(lambda x, dim: tp.copy_to_tp(x)), leaves(whole, *weights), grad_three, autocast)
        torch.testing.assert_close(copied[0], reference[0], rtol=0, atol=0)
        for got, want in zip(copied[1], reference[1]):
            assert got.dtype == want.dtype and (got - want).norm() <= 1e-2 * want.norm()

        # the slice kept for backward is the bf16 one the product read (the memory model's), not the fp32
        for fused in (lambda x, w, b: tp.gathered_linear(x, w, b, 1),
                      lambda x, w, b: overlapped.gathered_linear(x, w, b, 1, chunks)):
            assert saved_slices(fused, *leaves(shard, weight, bias)) == [torch.bfloat16]

        whole, weight = torch.randn(2, rows * t, 6), torch.randn(10, 6)
        grad_out = torch.randn(2, rows, 10)
        plain = run(lambda x, w: tp.reduce_scatter(F.linear(x, w), 1), leaves(whole, weight), grad_out, autocast)
        assert counts[0] == counts[1], counts
        counts = []
        for split in (False, True):
            piecewise, count = collectives_of(run, lambda x, w: overlapped.linear_reduce_scatter(x, w, 1, chunks),
                                              leaves(whole, weight), grad_out, autocast, split)
            counts.append(count)
            torch.testing.assert_close(piecewise[0], plain[0], **tolerance)
            for name, got, want in zip(("input", "weight"), piecewise[1], plain[1]):
                torch.testing.assert_close(got, want, **tolerance,
                                           msg=lambda m, name=name: f"linear_reduce_scatter {chunks} pieces {split=}, {name}: {m}")
            assert piecewise[0].dtype == plain[0].dtype
        assert counts[0] == counts[1], counts
print("ok", rank, flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # as tests/sp_collectives_rank.py: the test is not of torch's C++ teardown
