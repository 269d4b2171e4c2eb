"""Sequence-parallel linears whose collectives run while their matrix products compute.

Under sequence parallelism (``autopart.runtime.collectives``) a column-parallel linear reads its
input gathered over the sequence, and a row-parallel linear's partial output is reduce-scattered
back to each rank's slice. Done whole, each collective and the product beside it wait for each
other. Here the sequence is cut into ``chunks`` pieces and pipelined: piece j + 1's collective is
in flight (``async_op``: on NCCL its own stream) while piece j is multiplied, and a gathered
linear first multiplies the rows it holds, while the first piece is gathered. This is the
decomposition of Wang et al. (ASPLOS'23, "Overlap communication with dependent computation via
decomposition") that Megatron-LM runs as ``--tp-comm-overlap``, there as a ring of point-to-point
copies; here each piece is one collective of the whole group, which NCCL and gloo run as they run
the plain functions' (no pairwise communicators to set up, nothing that orders sends across
ranks). ``autopart.solve.overlap`` prices it and chooses the pieces per linear.

Piece j is every rank's j-th part of its own slice, so the layouts are the plain functions': the
gathered product in sequence order, the scattered one each rank's contiguous slice. Products of a piece run in the activations' dtype, as autocast
runs the whole linear; the weight's gradient is one product over all pieces, after the last
collective has started, so that it rounds as the plain linear's does.

Under a zero-bubble schedule's split backward (``autopart.runtime.backward``) each node computes
its input's gradient in I and its weight's in W; the reduce-scattered linear keeps the output
gradient it gathered in I for W, as autograd keeps a plain linear's incoming gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.nn import functional as F

from autopart.runtime.backward import backward_phase
from autopart.runtime.collectives import (all_gathered, group, group_rank, group_size, product_dtype,
                                         reduce_scatter_into)

__all__ = ["gathered_linear", "linear_reduce_scatter"]


def _start_gather(piece: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
    """Every rank's ``piece``, in rank order, once the returned call waits for them."""
    held = [piece.contiguous()]  # read until the collective ends (a copy, where the piece was not contiguous)
    out, work = all_gathered(held[0], group_size(), group=group(), async_op=True)

    def done() -> list[torch.Tensor]:
        work.wait()
        held.clear()
        return list(out.chunk(group_size()))

    return done


def _gathered_in_turn(pieces: tuple[torch.Tensor, ...]) -> Iterator[list[torch.Tensor]]:
    """Each of ``pieces`` gathered, in turn. Every gather starts now: a collective started later
    would wait (on NCCL's stream) for the products queued before it, where these need nothing
    but their pieces; the caller's products of one piece run while the next ones arrive."""
    started = [_start_gather(piece) for piece in pieces]
    return (done() for done in started)


def _start_reduce_scatter(part: torch.Tensor, dim: int) -> Callable[[], torch.Tensor]:
    """This rank's 1/t of ``part`` along ``dim``, summed over the group, once the returned call waits."""
    held = [part.movedim(dim, 0).contiguous()]  # a reduce-scatter splits along dim 0; read until it ends
    out = held[0].new_empty((held[0].shape[0] // group_size(), *held[0].shape[1:]))
    work = reduce_scatter_into(out, held[0], group=group(), async_op=True)

    def done() -> torch.Tensor:
        work.wait()
        held.clear()
        return out.movedim(0, dim)

    return done


def _part(whole: torch.Tensor, dim: int, chunks: int, j: int) -> torch.Tensor:
    """Piece j of a whole sequence: the j-th of ``chunks`` parts of every rank's slice, in rank order."""
    t = group_size()
    rows = whole.shape[dim] // (t * chunks)
    return whole.unflatten(dim, (t, chunks, rows)).select(dim + 1, j).flatten(dim, dim + 1)


def _whole(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The sequence that ``_part`` cut into ``parts``."""
    t = group_size()
    return torch.stack([p.unflatten(dim, (t, p.shape[dim] // t)) for p in parts], dim + 1).flatten(dim, dim + 2)


def _others(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The other ranks' pieces of a gather, in rank order: this rank's own is computed first."""
    return torch.cat(pieces[:group_rank()] + pieces[group_rank() + 1:], dim)


def _whole_from(own: torch.Tensor, others: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from this rank's own slice and, per piece, the other ranks' rows of it
    (``_others``' order)."""
    t, r = group_size(), group_rank()
    per_piece = [o.unflatten(dim, (t - 1, o.shape[dim] // (t - 1))).unbind(dim) for o in others]  # piece -> ranks
    slices = [torch.cat([piece[q if q < r else q - 1] for piece in per_piece], dim) for q in range(t) if q != r]
    return torch.cat(slices[:r] + [own] + slices[r:], dim)


def _wanted(ctx) -> tuple[bool, bool]:
    """Whether this backward computes the input's gradient and the weight's: a zero-bubble
    schedule's I wants the first, its W the second (``autopart.runtime.backward.backward_phase``;
    autograd would run the whole node in both)."""
    phase = backward_phase()
    return ctx.needs_input_grad[0] and phase != "weight", ctx.needs_input_grad[1] and phase != "input"


def _weight_gradient(grads: list[torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
    """grad^T @ input over every piece, as one product: the plain linear's rounding (a product
    per piece would round each to the activations' dtype before they are summed)."""
    grad = torch.cat([g.reshape(-1, g.shape[-1]) for g in grads])
    x = torch.cat([x.reshape(-1, x.shape[-1]) for x in inputs])
    return grad.t() @ x


class _GatheredLinear(torch.autograd.Function):
    """``F.linear(gather_from_sequence(shard, dim), weight, bias)`` in pieces: this rank's own
    rows first, while the first piece is gathered, then the others' rows of each piece while the
    next is. Only the slice is saved; backward gathers it again beside the input gradient's
    products, and reduce-scatters the input's gradient piece by piece, the last ones beside the
    weight's gradient."""

    @staticmethod
    def forward(ctx, shard, weight, bias, dim: int, chunks: int):
        dim = dim % shard.dim()
        ctx.dim, ctx.chunks, ctx.has_bias, ctx.shard_dtype = dim, chunks, bias is not None, shard.dtype
        low = shard.to(product_dtype(shard))  # gathered and kept as the products read it
        turns = _gathered_in_turn(low.chunk(chunks, dim))
        own = F.linear(low, weight, bias)
        others = [F.linear(_others(gathered, dim), weight, bias) for gathered in turns]
        ctx.save_for_backward(low, weight)
        return _whole_from(own, others, dim)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        dim, chunks, w = ctx.dim, ctx.chunks, weight.to(grad.dtype)  # the product's dtype, as autocast cast it
        wants_input, wants_weight = _wanted(ctx)
        grads = [_part(grad, dim, chunks, j) for j in range(chunks)]
        # the gathers first: only the weight gradient, last, reads them; each reduce-scatter
        # follows its piece's input gradient, and only the caller reads them
        gathering = [_start_gather(piece) for piece in shard.to(grad.dtype).chunk(chunks, dim)] if wants_weight else []
        scattering = [_start_reduce_scatter(g @ w, dim) for g in grads] if wants_input else []
        grad_weight = grad_bias = grad_shard = None
        if wants_weight:
            gathered = [torch.cat(done(), dim) for done in gathering]
            grad_weight = _weight_gradient(grads, gathered).to(weight.dtype)
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        if wants_input:
            grad_shard = torch.cat([done() for done in scattering], dim).to(ctx.shard_dtype)
        return grad_shard, grad_weight, grad_bias, None, None


class _LinearReduceScatter(torch.autograd.Function):
    """``reduce_scatter(F.linear(whole, weight), dim)`` in pieces: each piece's product is
    reduce-scattered while the next one computes. Backward gathers the output's gradient piece
    by piece: this rank's own rows' input gradient first, beside the first piece's gather, then
    the others' rows of each piece beside the next, then the weight's gradient."""

    @staticmethod
    def forward(ctx, whole, weight, dim: int, chunks: int):
        dim = dim % whole.dim()
        ctx.dim, ctx.chunks = dim, chunks
        scattering = []
        for j in range(chunks):
            product = F.linear(_part(whole, dim, chunks, j), weight)
            scattering.append(_start_reduce_scatter(product, dim))
        # kept in the product's dtype, as autocast's linear keeps its cast copy of the input
        ctx.save_for_backward(whole.to(product.dtype) if whole.is_floating_point() else whole, weight)
        ctx.input_dtype = whole.dtype
        return torch.cat([done() for done in scattering], dim)

    @staticmethod
    def backward(ctx, grad):
        whole, weight = ctx.saved_tensors
        dim, chunks, w = ctx.dim, ctx.chunks, weight.to(grad.dtype)
        wants_input, wants_weight = _wanted(ctx)
        grads, own, others = getattr(ctx, "gathered", None), None, []
        if grads is None or wants_input:  # W reuses what I gathered, as a split plain linear keeps its gradient
            turns = _gathered_in_turn(grad.chunk(chunks, dim))
            own = grad @ w if wants_input else None
            grads = []
            for gathered in turns:
                grads.append(torch.cat(gathered, dim))
                if own is not None:
                    others.append(_others(gathered, dim) @ w)
        ctx.gathered = grads if backward_phase() == "input" else None
        grad_weight = None
        if wants_weight:
            inputs = [_part(whole, dim, chunks, j).to(grad.dtype) for j in range(chunks)]
            grad_weight = _weight_gradient(grads, inputs).to(weight.dtype)
        grad_whole = _whole_from(own, others, dim).to(ctx.input_dtype) if own is not None else None
        return grad_whole, grad_weight, None, None


def gathered_linear(shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dim: int,
                    chunks: int) -> torch.Tensor:
    """The linear of a sequence slice gathered over the group (``collectives.gathered_linear``),
    its gather in ``chunks`` pieces overlapped with the product."""
    if group_size() == 1:
        return F.linear(shard, weight, bias)
    return _GatheredLinear.apply(shard, weight, bias, dim, chunks)


def linear_reduce_scatter(whole: torch.Tensor, weight: torch.Tensor, dim: int, chunks: int) -> torch.Tensor:
    """This rank's slice along ``dim`` of the group's summed ``F.linear(whole, weight)``
    (``collectives.reduce_scatter`` of a row-parallel linear), in ``chunks`` pieces overlapped
    with the product."""
    if group_size() == 1:
        return F.linear(whole, weight)
    return _LinearReduceScatter.apply(whole, weight, dim, chunks)

