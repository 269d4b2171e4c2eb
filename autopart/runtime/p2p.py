"""Activations forward and gradients backward between pipeline stages.

Ordered ``isend``/``irecv`` pairs, one tensor at a time: messages between two ranks match in the
order they are posted (NCCL ignores tags). Activations and gradients go over two process groups,
so each direction is its own channel: a V-shape schedule (zbv) sends a rank's neighbour
activations of one chunk and gradients of the other in an order the neighbour does not receive
them in, and each direction alone stays in order. `autopart.schedule.check_message_order`
proves that of a schedule when the plan is loaded. (gloo's ``batch_isend_irecv`` is no real
batch and is known to hang.) Sends are asynchronous and waited for at the end of the step;
receives are waited for before the action that consumes them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopart.ir.tensors import TensorMeta

__all__ = ["send_tensors", "recv_tensors"]


def send_tensors(tensors: list[torch.Tensor], peer: int, group: dist.ProcessGroup | None = None) -> list[dist.Work]:
    """Post the sends; ``group`` (the gradient channel) spans every rank, so ``peer`` is a global rank there too."""
    return [dist.isend(t.detach().contiguous(), peer, group=group) for t in tensors]


def recv_tensors(
    metas: list[TensorMeta], peer: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    buffers = [torch.empty(m.shape, dtype=getattr(torch, m.dtype), device=device) for m in metas]
    works = [dist.irecv(buffer, peer, group=group) for buffer in buffers]
    for work in works:
        work.wait()
    return buffers
