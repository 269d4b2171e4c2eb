"""Activations forward and gradients backward between pipeline stages.

Ordered ``isend``/``irecv`` pairs, one tensor at a time: messages between two ranks match in the
order they are posted (NCCL ignores tags). Activations and gradients go over two process groups,
so each direction is its own channel: a V-shape schedule (zbv) sends a rank's neighbour
activations of one chunk and gradients of the other in an order the neighbour does not receive
them in, and each direction alone stays in order. `autopart.schedule.check_message_order`
proves that of a schedule when the plan is loaded. (gloo's ``batch_isend_irecv`` is no real
batch and is known to hang.) Sends are asynchronous and waited for at the end of the step;
receives are waited for before the action that consumes them.

With tensor parallelism, a message is split over the tensor-parallel group
(`autopart.ir.scatter_gather`): each rank sends its 1/t of a replicated tensor and the receivers
all-gather the parts; a sequence-parallel tensor is each rank's slice already, sent and kept as
it is. Every rank of a group runs the same action list, so the all-gathers of a receive meet in
the same order on all of them, between the stage's own collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopart.ir.scatter_gather import gathered, held_shape, parts
from autopart.ir.tensors import TensorMeta

__all__ = ["Scatter", "send_tensors", "recv_tensors"]


@dataclass(frozen=True)
class Scatter:
    """This rank's place in its tensor-parallel group, over which its messages are split."""

    group: dist.ProcessGroup
    rank: int
    size: int


def send_tensors(tensors: list[torch.Tensor], peer: int, scatter: Scatter | None = None,
                 group: dist.ProcessGroup | None = None, *, metas: list[TensorMeta] | None = None) -> list[dist.Work]:
    """Post the sends of ``tensors``, which the plan describes as ``metas`` (None: all replicated);
    ``group`` (the gradient channel) spans every rank, so ``peer`` is a global rank there too."""
    metas = metas if metas is not None else [None] * len(tensors)
    return [dist.isend(_part(t.detach(), m, scatter), peer, group=group) for t, m in zip(tensors, metas, strict=True)]


def recv_tensors(
    metas: list[TensorMeta], peer: int, device: torch.device, scatter: Scatter | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    tp = scatter.size if scatter else 1
    shapes = [(held_shape(m, tp), parts(m.numel, tp) if gathered(m, tp) else 1) for m in metas]
    buffers = [torch.empty(math.prod(shape) // n, dtype=getattr(torch, m.dtype), device=device)
               for m, (shape, n) in zip(metas, shapes)]
    works = [dist.irecv(buffer, peer, group=group) for buffer in buffers]
    for work in works:
        work.wait()
    return [_gathered(b, shape, n, scatter) for b, (shape, n) in zip(buffers, shapes)]


def _part(tensor: torch.Tensor, meta: TensorMeta | None, scatter: Scatter | None) -> torch.Tensor:
    """The share of ``tensor`` this rank sends: its 1/t where a replicated tensor splits, else all
    of what it holds (a sequence-parallel slice is its share already)."""
    held_whole = scatter is None or (meta is not None and not gathered(meta, scatter.size))
    if held_whole or parts(tensor.numel(), scatter.size) == 1:
        return tensor.contiguous()
    return tensor.contiguous().reshape(-1).chunk(scatter.size)[scatter.rank].contiguous()


def _gathered(buffer: torch.Tensor, shape: tuple[int, ...], split: int, scatter: Scatter | None) -> torch.Tensor:
    if split == 1:
        return buffer.view(shape)
    pieces = [torch.empty_like(buffer) for _ in range(split)]
    dist.all_gather(pieces, buffer, group=scatter.group)
    return torch.cat(pieces).view(shape)
