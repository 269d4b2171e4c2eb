"""Autograd-aware tensor-parallel collectives, and the ops that run on vocabulary shards.

The generated stage programs call these as ``tp.all_reduce(x)`` and so on. Each one is a
conversion between placements (see ``autopart.solve.sharding``) whose backward is the
conversion's adjoint:

| function        | forward                     | backward               |
|-----------------|-----------------------------|------------------------|
| ``all_reduce``  | P -> R: sum the partials    | identity               |
| ``copy_to_tp``  | identity (R used by a split op) | sum the partial gradients |
| ``copy_for_products`` | the same, for matrix products alone | the same, in their dtype |
| ``all_gather``  | S(d) -> R                   | keep the local slice   |
| ``scatter``     | R -> S(d): keep the local slice | all-gather         |
| ``reduce_scatter`` | P -> S(d): sum, keep the local slice | all-gather    |
| ``gather_from_sequence`` | S(d) -> R for a split op | reduce-scatter |
| ``gather_for_products`` | the same, for matrix products alone | reduce-scatter |

The last two are Megatron's sequence parallelism (Korthikanti et al.): the all-reduce after a
row-parallel linear becomes a reduce-scatter into the sequence-split region, and the input of a
column-parallel linear is gathered from it; ``gather_from_sequence``'s gradient arrives partial
(each rank's split op saw the whole input), so its backward sums as it scatters, where
``all_gather`` followed by ``copy_to_tp`` would all-reduce the whole gradient and then slice it.
Where only matrix products read what is gathered (q, k and v of a Llama layer's norm), it moves
in the dtype they read under autocast (``gather_for_products``), as Megatron gathers bf16; the
same holds of the gradient ``copy_to_tp`` sums (``copy_for_products``).

``S(d, g)`` tensors hold a slice of each of g groups: gathering puts every group back together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn import functional as F

from autopart.runtime.backward import backward_phase
from autopart.runtime.draws import draw_seed

__all__ = [
    "set_group",
    "group",
    "group_size",
    "group_rank",
    "all_reduce",
    "copy_to_tp",
    "copy_weight_to_tp",
    "copy_for_products",
    "all_gather",
    "scatter",
    "reduce_scatter",
    "gather_from_sequence",
    "gather_for_products",
    "gathered_linear",
    "product_dtype",
    "reduce_scatter_into",
    "all_gathered",
    "vocab_parallel_embedding",
    "vocab_parallel_cross_entropy",
    "sharded_dropout",
    "sharded_attention",
]

_GROUP: dist.ProcessGroup | None = None


def set_group(group: dist.ProcessGroup | None) -> None:
    """The tensor-parallel group of this rank; the runtime sets it once before building stages."""
    global _GROUP
    _GROUP = group


def group() -> dist.ProcessGroup | None:
    """The tensor-parallel group (None: this rank alone)."""
    return _GROUP


def group_size() -> int:
    return dist.get_world_size(_GROUP) if _GROUP is not None else 1


def product_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a matrix product of ``tensor`` runs in here: under the forward's autocast, its
    lower precision for an fp32 tensor (autocast casts a product's fp32 inputs to it), else the
    tensor's own. A gathered linear gathers its input cast to it: the same values, half the bytes
    of gathering fp32 (a norm's output, on autocast's fp32 list) and casting after."""
    device = tensor.device.type
    if tensor.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype


def group_rank() -> int:
    return dist.get_rank(_GROUP) if _GROUP is not None else 0


def _reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    tensor = tensor.contiguous().clone()
    if group_size() > 1:
        dist.all_reduce(tensor, op=op, group=_GROUP)
    return tensor


def _local_slice(tensor: torch.Tensor, dim: int, groups: int) -> torch.Tensor:
    t, r = group_size(), group_rank()
    return torch.cat([part.chunk(t, dim)[r] for part in tensor.chunk(groups, dim)], dim).contiguous()


def reduce_scatter_into(out: torch.Tensor, whole: torch.Tensor, **kwargs):
    """torch's reduce-scatter of one tensor, under its newer name where the torch at hand has it
    (``reduce_scatter_single``; the older ``reduce_scatter_tensor`` warns that it is deprecated),
    looked up at each call as the test suite's device checker wraps them."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, whole, **kwargs)


def all_gathered(piece: torch.Tensor, size: int, **kwargs) -> tuple[torch.Tensor, dist.Work | None]:
    """torch's all-gather of one contiguous tensor per rank of a group of ``size`` into one new
    tensor, the pieces one after another in rank order along its first dimension, and the
    collective's work (``async_op``). ``all_gather_single``, the newer name, where the torch at
    hand has it: NCCL gathers into one buffer, where a list of outputs is gathered there and
    copied out piece by piece."""
    out = piece.new_empty((size * piece.shape[0], *piece.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return out, gather(out, piece, **kwargs)


def _gather(tensor: torch.Tensor, dim: int, groups: int) -> torch.Tensor:
    t = group_size()
    out, _ = all_gathered(tensor.contiguous(), t, group=_GROUP)
    per_rank = [piece.chunk(groups, dim) for piece in out.chunk(t)]  # rank -> its slice of each group
    return torch.cat([per_rank[r][g] for g in range(groups) for r in range(t)], dim)


def _reduce_slice(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """The local slice along ``dim`` of the sum over the group."""
    t = group_size()
    if t == 1:
        return tensor.contiguous().clone()
    moved = tensor.movedim(dim, 0).contiguous()  # a reduce-scatter splits along dim 0
    out = torch.empty((moved.shape[0] // t, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    reduce_scatter_into(out, moved, group=_GROUP)
    return out.movedim(0, dim).contiguous()


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return _reduce(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _reduce(grad)


class _CopyWeightToTP(_CopyToTP):
    """``copy_to_tp`` of a weight (a norm's under sequence parallelism): its partial gradients
    are summed in fp32 and rounded once where they are 16-bit (a ``bf16`` working weight's), as
    every weight gradient is reduced (`autopart.ir.tensors.DTYPES`); a 16-bit sum over t ranks
    rounds up to t - 1 times."""

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if grad.dtype in (torch.bfloat16, torch.float16):
            return _reduce(grad.float()).to(grad.dtype)
        return _reduce(grad)


class _CopyForProducts(torch.autograd.Function):
    """``copy_to_tp`` of an activation that only matrix products read (the codegen checks): they
    read it in `product_dtype`, so its gradient comes from products of that dtype, and is summed
    over the group in it, as Megatron's f sums its bf16 gradient (under bf16 autocast a norm's
    output is fp32: summed as it is, twice the bytes)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        ctx.moved = product_dtype(tensor)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _reduce(grad.to(ctx.moved)).to(grad.dtype)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int, groups: int) -> torch.Tensor:
        ctx.dim, ctx.groups = dim, groups
        return _gather(tensor, dim, groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _local_slice(grad, ctx.dim, ctx.groups), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int, groups: int) -> torch.Tensor:
        ctx.dim, ctx.groups = dim, groups
        return _local_slice(tensor, dim, groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.dim, ctx.groups), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _reduce_slice(tensor, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.dim, 1), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _gather(tensor, dim, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_slice(grad, ctx.dim), None


class _GatherForProducts(torch.autograd.Function):
    """``gather_from_sequence`` of a value that only matrix products read (the codegen checks):
    gathered in the dtype they read (`product_dtype`) and handed back in its own, which they cast
    to theirs again, so each reads the values it would have read of the fp32 gather, and the
    gradients of several readers still sum in fp32. The gradient is reduce-scattered in that
    dtype too, as ``gathered_linear``'s is: under bf16 autocast the bytes Megatron-SP moves."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim, ctx.moved = dim, product_dtype(tensor)
        return _gather(tensor.to(ctx.moved), dim, 1).to(tensor.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_slice(grad.to(ctx.moved), ctx.dim).to(grad.dtype), None


class _GatheredLinear(torch.autograd.Function):
    """``F.linear(gather_from_sequence(x, dim), weight, bias)`` that keeps only the local slice of
    x for backward and gathers it again there, as Megatron-SP's linear does: the gathered input,
    t times the slice, is never held between forward and backward. The slice is gathered and kept
    in the dtype the product reads (`product_dtype`), as autocast's linear keeps its cast copy of
    its input: the same values as gathering it whole and casting after. Under a split backward
    (zero-bubble schedules) it computes the input's gradient in I and the weight's in W, each
    with its own collective, where autograd would have it compute both in each."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dim: int) -> torch.Tensor:
        ctx.dim, ctx.has_bias, ctx.shard_dtype = dim, bias is not None, shard.dtype
        low = shard.to(product_dtype(shard))
        ctx.save_for_backward(low, weight)
        return F.linear(_gather(low, dim, 1), weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard, weight = ctx.saved_tensors
        phase = backward_phase()  # a zero-bubble schedule runs this in I and again in W: each its half
        grad_shard = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0] and phase != "weight":
            grad_shard = _reduce_slice(grad @ weight.to(grad.dtype), ctx.dim).to(ctx.shard_dtype)
        if phase != "input":
            whole = _gather(shard.to(grad.dtype), ctx.dim, 1)  # the product's dtype: as kept
            flat_grad = grad.reshape(-1, grad.shape[-1])
            grad_weight = (flat_grad.t() @ whole.reshape(-1, whole.shape[-1])).to(weight.dtype)
            grad_bias = flat_grad.sum(0) if ctx.has_bias else None
        return grad_shard, grad_weight, grad_bias, None


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return _AllReduce.apply(tensor)


def copy_to_tp(tensor: torch.Tensor) -> torch.Tensor:
    return _CopyToTP.apply(tensor)


def copy_weight_to_tp(tensor: torch.Tensor) -> torch.Tensor:
    return _CopyWeightToTP.apply(tensor)


def copy_for_products(tensor: torch.Tensor) -> torch.Tensor:
    return _CopyForProducts.apply(tensor)


def all_gather(tensor: torch.Tensor, dim: int, groups: int = 1) -> torch.Tensor:
    return _AllGather.apply(tensor, dim, groups)


def scatter(tensor: torch.Tensor, dim: int, groups: int = 1) -> torch.Tensor:
    return _Scatter.apply(tensor, dim, groups)


def reduce_scatter(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    return _ReduceScatter.apply(tensor, dim)


def gather_from_sequence(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    return _GatherFromSequence.apply(tensor, dim)


def gather_for_products(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    return _GatherForProducts.apply(tensor, dim)


def gathered_linear(shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, dim: int = 1) -> torch.Tensor:
    return _GatheredLinear.apply(shard, weight, bias, dim)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of a vocabulary-sharded embedding: each rank looks up the ids it holds, zeros elsewhere.
    The result is partial (P): summed over the group it is the full embedding."""
    rows = weight.shape[0]
    start = group_rank() * rows
    outside = (ids < start) | (ids >= start + rows)
    local = torch.where(outside, torch.zeros_like(ids), ids - start)
    return F.embedding(local, weight) * (~outside).unsqueeze(-1).to(weight.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's cross-entropy over logits sharded along the vocabulary: the max, the sum of
    exponentials and the target's logit are all-reduced, never the logits themselves. It computes
    in fp32 whatever the logits' dtype, as autocast runs ``cross_entropy`` (on its fp32 list) and
    Megatron-LM its loss (``output.float()``); the logits' gradient goes back in their dtype."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        ctx.logits_dtype = logits.dtype
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        rows = logits.shape[-1]
        start = group_rank() * rows
        logits_max = _reduce(logits.detach().max(dim=-1).values, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _reduce(exp.sum(dim=-1))
        inside = (target >= start) & (target < start + rows)
        local_target = torch.where(inside, target - start, torch.zeros_like(target))
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
        target_logit = _reduce(target_logit)
        valid = target != ignore_index
        count = valid.sum().clamp(min=1).to(logits.dtype)
        losses = (sum_exp.log() - target_logit) * valid.to(logits.dtype)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_target, inside, valid)
        ctx.count = count
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_target, inside, valid = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local_target] -= inside.to(grad_logits.dtype)
        grad_logits *= (valid.to(grad_logits.dtype) * grad / ctx.count).unsqueeze(-1)
        return grad_logits.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of (N, V/t) logit shards against (N,) targets; replicated result."""
    return _VocabParallelCrossEntropy.apply(logits, target, ignore_index)


def sharded_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout`` of a tensor split over the tensor-parallel group (the sequence-parallel
    region, a column-split hidden): each rank draws its slice's mask from a stream of its own, as
    Megatron's model-parallel generator does, where the forward's one stream would repeat one
    pattern on every slice (`_own_stream`)."""
    with _own_stream(input):
        return F.dropout(input, p, training, inplace)


def sharded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with dropout on the probabilities, split over the heads
    (or the batch): each rank's heads draw from a stream of their own (`_own_stream`)."""
    with _own_stream(query):
        return F.scaled_dot_product_attention(query, key, value, *args, **kwargs)


@contextlib.contextmanager
def _own_stream(tensor: torch.Tensor) -> Iterator[None]:
    """This rank's stream for a split tensor's draws. Its seed is drawn from the forward's CPU
    generator, the same on every rank and replayed by a recompute; the forward's own streams go
    on as they were."""
    base = int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))
    devices = [tensor.device] if tensor.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(draw_seed(base, group_rank()))
        yield
